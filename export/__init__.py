"""Checkpoint directory -> model repository (the contract: manifest.py).

    python -m export --checkpoint runs/X --out models/NAME [--format onnx] [--quantize int8]

models/NAME/ holds model.json (manifest.py), spm.model, encoder.onnx, decoder.onnx and decoder2.onnx
(and global.onnx for capsule models), and with --quantize int8 an int8 twin of each (quantize.py).

The graphs (names and axes declared in spec.py; R rows = the beams of all sentences, any mix):
  encoder.onnx  src_ids (batch, src_len) int64 [, src_tags (batch, src_len) int64 for POS models]
             -> src_pad (batch, src_len) bool [, global_state, gate_source (batch, D) for GRET],
                cross_key.i / cross_value.i (batch, H, src_len, d_h) per decoder layer i; a
                capsule model gives capsule_votes (M*tokens, K*d_c) for the real tokens of its
                M routed layers instead of the global state: the runtime routes them on the host
                (kernels.routing.route_votes), then
  global.onnx   capsules (M*batch, K, d_c) -> global_state [, gate_source] (batch, D)
  decoder.onnx  tokens (R,) int64, positions (R,) int64 (the keys each row holds: its columns
                0..positions[r] - 1 of the cache), row_sentence (R,) int64, the encoder's outputs,
                past_key.i / past_value.i (R, H, past_len, d_h), past_len > max(positions)
             -> log_probs (R, V) float32, present_key.i / present_value.i (R, H, past_len, d_h): the
                past with this step's column written at positions[r] (ONNX Runtime's
                GroupQueryAttention; bound to the past's own memory, the cache is updated in place),
                block_max (R, V / 64): the maxima of 64-column blocks of log_probs, from which the
                runtime picks each row's best tokens for the beam search (training.seq2seq.beam.row_top_k)
  decoder2.onnx the same step over sentences in two length classes (the serving engine's encoder
                slots: server/engine/source_slots.py), each class padded to its own longest source:
                class 1's group_rows and encoder outputs are named class1.NAME

Modules: spec.py (what the graphs hold), graphs.py (the modules that are traced: the encoder pass,
the global state after routing and the model's own decoder step, Seq2Seq.step_rows),
onnx_export.py (trace + check), quantize.py, manifest.py (model.json), repository.py (assembles
a repository), onnx_runtime.py (the ONNX Runtime backend: encode / decode_step / step / reorder).
"""
