"""The help formatter of every mimo_fn command line (the benches, the server, the clients, the scripts)."""

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and each option's default after its help, unless the help
    already says "(default: ...)" in words or the option is required (it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and ("(default:" in action.help or action.required):
            return action.help
        return super()._get_help_string(action)
