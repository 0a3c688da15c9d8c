"""The ``vllm-bole`` command: ``vllm-bole calibrate ...`` (see :mod:`vllm_bole.calibration.__main__`),
``vllm-bole draft-vocab ...`` (see :mod:`vllm_bole.calibration.draft_vocab`) and ``vllm-bole acceptance-profile ...``
(see :mod:`vllm_bole.calibration.acceptance_profile`)."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from .calibration import __main__ as calibration
    from .calibration import acceptance_profile, draft_vocab

    parser = argparse.ArgumentParser(prog="vllm-bole", description="Bole tree speculation for vLLM")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module in (("calibrate", calibration), ("draft-vocab", draft_vocab),
                         ("acceptance-profile", acceptance_profile)):
        summary = module.__doc__.splitlines()[0]
        module.build_parser(commands.add_parser(name, help=summary, description=summary)).set_defaults(
            run=module.run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
