"""What the decode-step commands (`tvmpipe generate`, `tvmpipe serve`) open, the same way: the
bundle's tokenizer (or `--tokenizer DIR`), and the pipeline on the cluster the options chose (the
cluster started or joined, the backend picked, the Pipeline built streaming tokens only: a
published decoder's logits are 128-600 KB a token)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from tvmpipe.app.connect import Cluster, open_cluster, pick_backend, pipeline_kwargs
from tvmpipe.app.options import ClusterOptions
from tvmpipe.core.errors import TvmpipeError

if TYPE_CHECKING:
    from tvmpipe.bundle import Bundle
    from tvmpipe.bundle.decode_layout import DecodeLayout
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.generation.text import TextCodec
    from tvmpipe.partition import Plan


def bundle_codec(bundle: "Bundle", layout: "DecodeLayout", tokenizer: str | None) -> "TextCodec | None":
    """The text codec of `--tokenizer DIR`, else of the bundle's own tokenizer directory, else None
    (token ids only). A tokenizer with more ids than the model's vocabulary is not the model's."""
    from tvmpipe.generation.text import load_text_codec

    if tokenizer and not os.path.isdir(tokenizer):
        raise TvmpipeError(f"--tokenizer {tokenizer}: not a directory (a local tokenizer directory)")
    where = tokenizer or bundle.tokenizer_dir
    if where is None:
        return None
    codec = load_text_codec(where)
    if codec.vocab_size > layout.vocab_size:
        raise TvmpipeError(f"the tokenizer in {where} has {codec.vocab_size} token ids, more than the model's "
                           f"vocabulary of {layout.vocab_size}: it is not this model's tokenizer")
    return codec


@dataclass(frozen=True)
class OpenPipeline:
    pipe: "Pipeline"
    cluster: Cluster
    backend: str


@contextlib.contextmanager
def open_decode_pipeline(options: ClusterOptions, bundle: "Bundle", plan: "Plan", *,
                         slots: int | None = None, scores: bool = False,
                         kv_tokens: int | None = None) -> Iterator[OpenPipeline]:
    """The pipeline for the duration of the block; it, then the cluster, closed afterwards.
    `scores`: its sampling stage sends the rows' log probabilities (a server's logprobs).
    `kv_tokens`: a paged step's pool in tokens (executor/kvpool.py); None: sized by the stages'
    free memory (a static step has no pool)."""
    from tvmpipe.cluster.driver import Pipeline
    from tvmpipe.executor.kvpool import AUTO

    kv = kv_tokens if kv_tokens is not None else AUTO  # a step without a pool: nothing to size
    with open_cluster(options, plan.num_stages) as cluster:
        backend = pick_backend(options.backend, cluster.gpus)
        kw = pipeline_kwargs(options, cluster, backend, plan.num_stages)
        with Pipeline(bundle, plan, slots=slots, logits=False, scores=scores, kv_tokens=kv, **kw) as pipe:
            yield OpenPipeline(pipe, cluster, backend)
