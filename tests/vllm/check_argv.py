"""Checks engine command lines with the engine's own parser and validation.

Run by the test venv's python: `check_argv.py ENGINE CASES.json RESULTS.json` where ENGINE is
`vllm` or `sglang` and CASES a list of {"name", "argv" (the words after the program), "env"}.
Writes one JSON object to RESULTS (vLLM logs to stdout): name -> null when the engine takes the
command line, else its refusal in its own words. Nothing is started.

vLLM: `vllm serve`'s parser, its argument checks, and the engine config built from them, as far
as `vllm serve` goes before loading weights. SGLang: `launch_server`'s parser and `ServerArgs`,
and its LoRA checks; the rest of its launch-time checks need the defaults it works out from
a GPU's memory, and this host has none.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path


def vllm(argv: list[str]) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args: Namespace = parser.parse_args(argv)
    command.validate(args)
    args.model = args.model_tag or args.model
    engine_args = AsyncEngineArgs.from_cli_args(args)
    engine_args.create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER, headless=args.headless
    )


def sglang(argv: list[str]) -> None:
    sys.path.insert(0, str(Path(sys.executable).parents[1] / "sglang-args"))
    from sglang.srt.arg_groups.lora_hook import check_lora_server_args
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    if args.enable_lora:
        check_lora_server_args(args)


def check(engine: Callable[[list[str]], None], argv: list[str], env: dict[str, str]) -> str | None:
    saved = dict(os.environ)
    os.environ.update(env)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            engine(argv)
        return None
    except SystemExit:  # argparse said why on stderr
        return said.getvalue().strip().splitlines()[-1]
    except Exception as error:  # every refusal is reported, in the engine's words
        lines = traceback.format_exception_only(error)
        return " ".join(line.strip() for line in lines)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    engine = {"vllm": vllm, "sglang": sglang}[sys.argv[1]]
    with open(sys.argv[2]) as file:
        cases = json.load(file)
    results = {case["name"]: check(engine, case["argv"], case["env"]) for case in cases}
    with open(sys.argv[3], "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main()
