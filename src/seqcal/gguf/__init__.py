"""GGUF output: llama.cpp's weight formats as calibration grids, and the file they are written to.

    types.py      the GGUF types (Q4_0, Q5_0, Q8_0, Q4_1, Q5_1, Q2_K .. Q6_K): blocks, codes, stored scales
    search.py     llama.cpp's sub-block scale searches of the k-quants, vectorized
    grids.py      GGUFFormat: qparams by llama.cpp's rule, codes, the values llama.cpp computes (s * c + b)
    pack.py       codes and scales -> the bytes of ggml's blocks
    scheme.py     GGUFScheme, the recipe names (types and llama.cpp's mixes: Q4_K_M, ...), the type per module
    families.py   llama.cpp's architecture, tensor names and hyperparameters of the families written
    gemma.py      Gemma 2 / Gemma 3 in llama.cpp's conventions: norms plus one, their keys, what is refused
    vocab.py      the tokenizer as GGUF metadata
    tensors.py    a module's GGUF tensors, each quantized one checked against seqcal's weight
    stream.py     GGUFStream: model.gguf written as subgraphs finish, read back and checked at the end
    preflight.py  what output_format="gguf" refuses before calibrating

A recipe names a GGUF scheme like any other (``GPTQModifier(scheme="Q4_K_M", ignore=["lm_head"])``; GPTQ, AWQ,
AutoRound and round to nearest calibrate on them); the calibrating algorithm chooses the codes on the type's grid
with the type's own scales, fixed first, and ``oneshot(..., output_format="gguf")`` writes
``output_dir/model.gguf``.
"""
