"""tvmpipe.compiler: model (ONNX, torch.export, built-in) -> tvmpipe bundle, with Apache TVM 0.27.

Modules, in pipeline order:
  models      built-in torch models with seeded weights
  zoo         published architectures with seeded weights, and their two export paths
  checkpoint  a local Hugging Face checkpoint directory (`tvmpipe compile DIR`)
  hfmodel     that checkpoint's transformers model, built without reading its weights
  ggufsource  a GGUF file (`tvmpipe compile FILE.gguf`): metadata, tensor directory, tokenizer
  ggufmodel   that file's transformers model, built without reading its weights, quantized ones packed
  quantize    `--quantize int4|int8`: group quantization of a float checkpoint's weights
  packed      packed (quantized) weights: block layouts, and the graph ops that dequantize them
  lazyweights weights as placeholder constants, their bytes held once, in their source
  tied        a tied embedding stored once, read by the input embedding and the LM head
  decoders    decode-step programs: one token of a decoder, its KV caches as explicit state
  pagedkv     TVM's paged-KV kernels (attention over a page table, append) in tvmpipe's launch form
  pagedops    those kernels as torch ops that torch.export traces into a paged decode step
  genspec     the generation section of a user's stateful .pt2 (`--decode` declarations)
  lift        buffers a torch.export program mutates in place, made graph state pairs
  importops   converters given to TVM's torch importer for checkpoint programs
  onnxprep    ONNX models prepared for TVM's importer, and its failures located
  frontend    SOURCE -> Relax main with weights bound as named constants
  rewrite     re-emit Relax main binding by binding (the base of the passes below)
  tecalls     importer `emit_te` calls turned back into Relax ops
  empties     zero-size concat operands dropped
  negindex    negative constant indices counted from the back, as torch counts them
  boolcmp     equal / not_equal of bool tensors, compared as int8
  scanops     cumsum / cumprod as plain reductions
  precision   float32 -> float16 conversion of a Relax program
  npfold      NumPy constant folding of weight preprocessing (fast path before FoldConstant)
  lowfold     what only folds after legalization, before the model ops are recorded
  constnames  weight names kept across constant folding
  opmap       model ops recorded before legalization; fused functions mapped back to them
  dequantfuse packed weights bound late and unpacked inside the matmul kernels that read them
  graphjson   fused Relax main -> graph.json with a storage plan
  launches    scheduled PrimFuncs -> launch lists (kernels.json) and CUDA source (kernels.cu)
  smallrows   a thread-block tile for matmuls of a few rows (a decode step at batch 2-16)
  export      the pipeline itself; `compile_model` writes the bundle
  cpucheck    runs a bundle on the CPU with TVM's LLVM build, as an independent numerical check
  progress    step lines with timings on stderr
  errors      the errors raised on purpose (printed without a traceback)
  cli         `tvmpipe compile`

TVM, torch and onnx are imported inside functions only: importing this package needs none of them.
"""

from tvmpipe.compiler.errors import CompileError, SourceError, TvmMissingError, UnsupportedOpError
from tvmpipe.compiler.export import Exported, compile_model, export

__all__ = ["CompileError", "SourceError", "TvmMissingError", "UnsupportedOpError", "Exported", "compile_model",
           "export"]
