"""`tvmpipe compile SOURCE -o DIR`: registered by tvmpipe/cli.py. Imports no TVM until it runs."""

from __future__ import annotations

import argparse
import sys

from tvmpipe.compiler.decoders import DECODERS
from tvmpipe.compiler.models import BUILTIN_MODELS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compile",
        help="compile a model (ONNX, torch.export .pt2, or built-in) into a bundle (needs the compile extra)",
        description="Compile SOURCE with Apache TVM into a tvmpipe bundle directory: graph.json, CUDA "
                    "kernels, launch lists, op programs and params. SOURCE is an .onnx file, a "
                    "torch.export program (.pt2, torch.export.save), a local Hugging Face checkpoint directory "
                    "(config.json and safetensors weights, as save_pretrained writes it: its forward pass, or with "
                    "--decode its decode step; nothing is downloaded), a GGUF file with --decode (llama, qwen2, qwen3, phi3, gpt2, gemma; "
                    "quantized weights kept packed and dequantized inside the matmul kernels), or a built-in model: "
                    + ", ".join(f"{m.name} ({m.description})" for m in BUILTIN_MODELS.values()) + ".",
    )
    p.add_argument("source", metavar="SOURCE",
                   help=".onnx file, .pt2 file, .gguf file, checkpoint directory, or built-in model name")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="bundle directory to write")
    p.add_argument("--arch", default="sm_90", help="CUDA architecture to generate code for (default: sm_90)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch size (built-in models: default 1; files: must match a static batch, "
                        "or sets a symbolic leading ONNX dimension)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype (default: the model's own, float32 for built-ins; a bf16/fp16 torch "
                        "program or checkpoint stays bf16/fp16); float16/bfloat16 converts a float32 model's inputs, "
                        "weights and compute, files included; a checkpoint or a GGUF file is built in any of the three "
                        "(a GGUF file's packed weights stay packed, unpacked to this dtype in the kernels)")
    p.add_argument("--name", default=None,
                   help="the bundle's model name (default: the built-in's name, the .pt2 program's module "
                        "class, or the .onnx file's stem)")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in models' weights (default 0)")
    p.add_argument("--omit-params", action="store_true",
                   help="leave the weights out; the bundle says they are generated from --seed on load "
                        "(tvmpipe.bundle.params.generate_params, not the built-in model's weights); for models whose "
                        "every param is a float weight: refused for decode steps and integer constants")
    p.add_argument("--decode", action="store_true",
                   help=f"compile one decode step of the decoder SOURCE ({', '.join(DECODERS)}: tiny "
                        "transformers configs, weights from --seed; or a checkpoint directory of one of these "
                        "families): inputs input_ids [B,1], position [B] and the KV cache (--kv: a page pool a layer and "
                        "the page table, or per-layer K/V caches), outputs logits [B,1,V] and the updated cache, "
                        "declared as state. A .pt2 whose caches are buffers updated "
                        "in place gets its generation section declared (--token-input ...)")
    p.add_argument("--max-context", type=int, default=None, metavar="T",
                   help="with --decode: the caches' static length, prompt included (default 64; a .pt2's must be "
                        "given)")
    p.add_argument("--seq-len", type=int, default=None, metavar="L",
                   help="a checkpoint directory without --decode: the forward pass's static sequence length "
                        "(default 64)")
    g = p.add_argument_group("a .pt2 decode step's generation section (--decode; inferred where the shapes "
                             "leave one choice)")
    g.add_argument("--token-input", metavar="NAME", help="the input of the step's token ids ([B, 1] or [B, C])")
    g.add_argument("--position-input", metavar="NAME", help="the input of the step's position ([B] or a scalar)")
    g.add_argument("--count-input", metavar="NAME",
                   help="with a [B, C > 1] token input: the input saying how many of a row's tokens are real")
    g.add_argument("--logits-output", metavar="INDEX|NAME", help="the output to sample ([B, V] or [B, 1, V])")
    p.add_argument("--chunk", type=int, default=None, metavar="C",
                   help="with --decode: up to C tokens a row per step (input_ids [B,C], count [B]): prompts go "
                        "in C tokens a step (chunked prefill), generated tokens one, in the same graph (default 1)")
    p.add_argument("--kv", choices=["static", "paged"], default=None,
                   help="with --decode: the KV cache's layout: paged, one pool of pages a layer shared by the "
                        "stage's rows, read and written through a page table the step takes as inputs "
                        "(docs/paged-kv.md), or static caches [B, H_kv, T, D] per layer and sequence slot. Default: "
                        "paged for built-in decoders, checkpoint directories and GGUF files; static, with the reason in "
                        "the log and bundle.json, where a paged step is not built (a .pt2's own step, pages of "
                        "bfloat16)")
    p.add_argument("--page-size", type=int, default=None, metavar="P",
                   help="with a paged cache: tokens a page (default 16)")
    p.add_argument("--kv-pages", type=int, default=None, metavar="N",
                   help="with a paged cache: pages in each layer's pool (default: every row at the max context, "
                        "batch x ceil(T / P))")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="a GGUF file's tokenizer directory (tokenizer.json, ...), for a file without tokenizer.ggml.* "
                        "(default: the file's own tokenizer and chat template, converted)")
    p.add_argument("--quantize", choices=["int4", "int8"], default=None,
                   help="with a checkpoint directory and --decode: group-quantize every linear layer (int4: MLC's "
                        "q4f16_1, a float16 scale per group; int8), kept packed and unpacked inside the matmul kernels")
    p.add_argument("--group-size", type=int, default=None, metavar="G",
                   help="with --quantize: values per scale (default 32)")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.add_argument("--quiet", action="store_true", help="no step lines on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tvmpipe.compiler.export import compile_model
    from tvmpipe.compiler.progress import Progress, native_stderr_silenced

    from tvmpipe.compiler.decoders import DEFAULT_MAX_CONTEXT
    from tvmpipe.compiler.errors import SourceError

    from tvmpipe.compiler.genspec import Declared

    if args.max_context is not None and not args.decode:
        raise SourceError("--max-context needs --decode")
    if args.chunk is not None and not args.decode:
        raise SourceError("--chunk needs --decode")
    if args.kv is not None and not args.decode:
        raise SourceError("--kv needs --decode")
    sized = args.page_size is not None or args.kv_pages is not None
    if sized and not args.decode:
        raise SourceError("--page-size and --kv-pages need --decode")
    if sized and args.kv == "static":
        raise SourceError("--page-size and --kv-pages size a paged KV cache: not with --kv static")
    kv = None  # the default: paged wherever it is built (export.default_kv)
    if args.kv == "paged" or sized:  # sizing the pool asks for one: refused where it cannot be built
        from tvmpipe.compiler.decoders import DEFAULT_PAGE_SIZE, KvOptions

        kv = KvOptions("paged", DEFAULT_PAGE_SIZE if args.page_size is None else args.page_size, args.kv_pages)
    elif args.kv == "static":
        kv = "static"
    flags = {"--token-input": args.token_input, "--position-input": args.position_input,
             "--count-input": args.count_input, "--logits-output": args.logits_output}
    given = [f for f, v in flags.items() if v is not None]
    pt2 = args.source.endswith(".pt2")
    if given and not (args.decode and pt2):
        raise SourceError(f"{given[0]} declares the generation section of a .pt2 compiled with --decode")
    decode, generation = None, None
    if args.decode and pt2:
        generation = Declared(args.token_input, args.position_input, args.count_input, args.logits_output,
                              args.max_context)
    elif args.decode:
        decode = DEFAULT_MAX_CONTEXT if args.max_context is None else args.max_context
    progress = Progress(stream=None if args.quiet else sys.stderr)
    with native_stderr_silenced(args.quiet):  # TVM's C++ warnings bypass sys.stderr
        path = compile_model(args.source, args.output, arch=args.arch, batch=args.batch, dtype=args.dtype,
                             seed=args.seed, omit_params=args.omit_params, overwrite=args.force, progress=progress,
                             name=args.name, decode=decode, chunk=1 if args.chunk is None else args.chunk,
                             seq_len=args.seq_len, generation=generation, tokenizer=args.tokenizer,
                             quantize=args.quantize, group_size=args.group_size, kv=kv)
    print(path)
    return 0
