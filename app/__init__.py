"""tvmpipe.app: the application layer, above cluster/. One flow for every front end.

`tvmpipe run`, `tvmpipe sweep`, `tvmpipe inspect` (app/cli.py) and `python -m tvmpipe.job` (deploy/job.py) only
parse their command lines and print or write; what they do is here:

- options.py: `ClusterOptions`, what a run asks of the cluster; args.py: the shared command-line
  options, each value checked where it is parsed (one line naming the option, exit 2);
- connect.py: open or join the cluster (`--local`, `--address` with connect-retry, `--processes`),
  and the Pipeline arguments for it;
- sources.py: the bundle (or a built-in example), a plan validated against its graph, the
  micro-batches; all checked before any cluster resource is taken;
- run.py: `PipelineRun` (connect, start, stream, keep what completed) and `run_checked` (compare
  with the single-process oracle, write outputs and timeline atomically);
- oracle.py: the single-process oracle and the comparison with it;
- sweep.py: the sweep's measurements (the plans and predictions are partition/'s);
- decoding.py: what the decode-step commands open alike: the bundle's tokenizer and the pipeline
  on the chosen cluster; prompts.py: a generation run's prompts (ids, text, chats, a prompts
  file), checked before any cluster resource is taken;
- generating.py: one generation run (prompts on the command line, or a batch job over a prompts
  file that resumes), progressbar.py its progress line; generate.py: `tvmpipe generate`;
- serving.py: `tvmpipe serve` (the server itself is tvmpipe.serve, above generation/);
- zoocheck.py: one model-zoo entry (compiler/zoo.py) exported, compiled and checked against torch,
  the TVM CPU build and K = 2, 3 splits (bench/zoo.py and tests/compiler/test_zoo.py).

Nothing heavy is imported here: `tvmpipe --help` loads args.py.
"""
