"""The model family: what a trained model is and how it is searched, and nothing of how it is trained.

- config.py: ModelConfig (every architecture switch), DataConfig, Checkpoint (config.json)
- model.py: Seq2Seq (encode once, decode_step per step), built from layers.py, gret.py (GRET),
  multiview.py (layer-wise multi-view decoding), graph_encoder.py, positions.py (sinusoids, mvPE)
- beam.py: the beam-search rule, written once; search.py: offline greedy and beam search
- checkpoint.py: a checkpoint directory (config.json + model.safetensors + spm.model) read and written

The server serves with this package (and export/ builds model repositories from it); the training
loop, its data preparation and the research tooling live beside it in training/ and the server
imports none of them (tests/test_layout.py).
"""
