"""The ``vllm-bole`` command: ``vllm-bole calibrate ...`` (see :mod:`vllm_bole.calibration.__main__`)."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from .calibration import __main__ as calibration

    parser = argparse.ArgumentParser(prog="vllm-bole", description="Bole tree speculation for vLLM")
    commands = parser.add_subparsers(dest="command", required=True)
    summary = calibration.__doc__.splitlines()[0]
    calibration.build_parser(commands.add_parser("calibrate", help=summary, description=summary))
    args = parser.parse_args(argv)
    return calibration.run(args)


if __name__ == "__main__":
    sys.exit(main())
