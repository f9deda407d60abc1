"""User-facing errors; each message names the file, key or flag at fault."""


class DFlashError(Exception):
    """Every user-facing error: the CLI prints it on one line and exits 1."""


class CheckpointError(DFlashError):
    """A checkpoint folder or repo is missing, incomplete or corrupt."""


class ConfigError(DFlashError):
    """A config.json lacks a required key or holds an invalid value."""


class MismatchError(DFlashError):
    """A drafter does not fit its target (vocabulary, hidden size, layers)."""


class InputError(DFlashError):
    """An argument is out of range: empty prompt, bad block size, bad flag."""


class RollbackError(DFlashError):
    """A target cache cannot remove rejected drafts exactly (names the layer and type)."""


class ValidationError(DFlashError):
    """A converted folder failed its checks; ``checks`` holds every check's result."""

    def __init__(self, message: str, checks=()):
        super().__init__(message)
        self.checks = list(checks)
