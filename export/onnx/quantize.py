"""Weight-only int8 / int4 versions of an exported decoder graph, made by ONNX Runtime's own quantiser.

`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer` replaces each MatMul whose weight is a
constant by a `com.microsoft::MatMulNBits` node: the weight is stored in blocks of `block_size` input
channels, each block as int8 / int4 codes with one float scale (symmetric, round to nearest), and
dequantised inside the kernel. Activations, norms, softmax, the K/V cache and the graph's inputs and
outputs stay float32, so a quantised graph keeps the fp32 graph's contract (runtime/backends/onnx.py binds
it the same way). The LM head (the one MatMul whose weight has vocab_size columns) stays float32, as
int4 runtimes keep it (runtime/memory/plan.py's head_precision): it is a small share of a real model's bytes
and the logits are what verification compares.

The quantised graph is a different model from the fp32 one: it IS the target when it is selected
(`backend.precision: int8`), and exactness (greedy identity, `edgespec certify`) holds against it."""
from __future__ import annotations

import logging
import os
from typing import Sequence

import onnx

from runtime.model.bundle import give_normal_mode

BITS = {"int8": 8, "int4": 4}

# MatMulNBits' accuracy_level per precision, the faster one on this CPU (ORT 1.32, 2 shared cores, plain decode
# tok/s, the variants interleaved in one process). Memory-bound stand-in (500 MB fp32): float32 graph 15.5,
# int8 level 0 (float32 compute) 0.4, int8 level 4 (int8 activations) 41.7, int4 level 0 4.7, int4 level 4
# 54.0. Cache-resident zoo: float32 263, int8 52 / 127, int4 239 / 103. Level 4 quantises each row's
# activations per block, so the target's numerics are the quantised graph's own (greedy identity and
# certify hold against it like any target's).
ACCURACY_LEVEL = {"int8": 4, "int4": 4}


def head_nodes(model: onnx.ModelProto, vocab_size: int) -> Sequence[str]:
    """Names of the MatMul nodes whose constant weight has vocab_size output columns (the LM head)."""
    shapes = {i.name: tuple(i.dims) for i in model.graph.initializer}
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and len(shapes.get(n.input[1], ())) == 2 and shapes[n.input[1]][1] == vocab_size]


def quantize_graph(src_path: str, out_path: str, precision: str, vocab_size: int, block_size: int = 32,
                   accuracy_level: int = 0) -> str:
    """Write a weight-only `precision` (int8 | int4) copy of the float32 graph at src_path to out_path
    (+ out_path.data). Returns out_path. `accuracy_level` is MatMulNBits' attribute: 0 = compute in the
    activations' float32 (weights dequantised in the kernel), 4 = quantise activations to int8 per block
    and use integer dot products (CPU); see ACCURACY_LEVEL."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if precision not in BITS:
        raise ValueError(f"precision {precision!r}: expected one of {sorted(BITS)}")
    model = onnx.load(src_path)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, bits=BITS[precision],
                                          accuracy_level=accuracy_level, op_types_to_quantize=("MatMul",))
    quantizer = MatMulNBitsQuantizer(model, bits=BITS[precision], block_size=block_size, is_symmetric=True,
                                     accuracy_level=accuracy_level,
                                     nodes_to_exclude=list(head_nodes(model, vocab_size)), algo_config=config)
    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = log.level
    log.setLevel(logging.WARNING)  # it logs every node it visits at INFO
    try:
        quantizer.process()
    finally:
        log.setLevel(level)
    for stale in (out_path, out_path + ".data"):
        if os.path.exists(stale):
            os.remove(stale)
    onnx.save(quantizer.model.model, out_path, save_as_external_data=True, all_tensors_to_one_file=True,
              location=os.path.basename(out_path) + ".data", size_threshold=1024)
    give_normal_mode(out_path, out_path + ".data")  # onnx's external-data writer creates it 0o600
    onnx.checker.check_model(out_path, full_check=False)
    return out_path
