"""The model family: what a model is, what it reads and how its outputs are searched.

- config.py: ModelConfig (every architecture switch), DataConfig, Checkpoint (config.json)
- model.py: Seq2Seq (encode once, decode_step per step), built from layers.py, gret.py (GRET),
  multiview.py (layer-wise multi-view decoding), graph_encoder.py, positions.py (sinusoids, mvPE)
- beam.py: the beam-search rule, written once; search.py: offline greedy and beam search
- checkpoint.py: a checkpoint directory (config.json + model.safetensors + spm.model) read and written
- inputs.py: what the model reads, from text: special ids, SentencePiece, a dataset's input style,
  source ids, aligned POS tags, padded batches; pos_tags.py: the POS taggers (Universal POS ids)

The server serves with this package, and export/ builds model repositories from it. Around it in
training/: the corpora (corpora.py) and metrics (metrics.py), the training loop (train.py,
distributed.py) and its data preparation (data.py), and the research tooling (decode, translate,
evaluate, ship, study, gret_probe, demo, runs.sh). The server imports none of the last three
(tests/test_layout.py).
"""
