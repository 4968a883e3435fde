"""tvmpipe.compiler: model (ONNX, torch.export, built-in) -> tvmpipe bundle, with Apache TVM 0.27.

Modules, in pipeline order:
  models      built-in torch models with seeded weights
  frontend    SOURCE -> Relax main with weights bound as named constants
  precision   float32 -> float16 conversion of a Relax program
  npfold      NumPy constant folding of weight preprocessing (fast path before FoldConstant)
  constnames  weight names kept across constant folding
  opmap       model ops recorded before legalization; fused functions mapped back to them
  graphjson   fused Relax main -> graph.json with a storage plan
  launches    scheduled PrimFuncs -> launch lists (kernels.json) and CUDA source (kernels.cu)
  export      the pipeline itself; `compile_model` writes the bundle
  cpucheck    runs a bundle on the CPU with TVM's LLVM build, as an independent numerical check
  cli         `tvmpipe compile`

TVM, torch and onnx are imported inside functions only: importing this package needs none of them.
"""

from tvmpipe.compiler.errors import CompileError, SourceError, TvmMissingError, UnsupportedOpError
from tvmpipe.compiler.export import Exported, compile_model, export

__all__ = ["CompileError", "SourceError", "TvmMissingError", "UnsupportedOpError", "Exported", "compile_model",
           "export"]
