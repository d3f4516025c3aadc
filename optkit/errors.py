"""User-facing errors: each message says what is wrong and what to change."""


class OptkitError(Exception):
    """A mistake in the user's input; the CLI prints it on one line and exits with code 2."""

    exit_code = 2
