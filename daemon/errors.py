"""User-facing errors: each one prints as a single clear line (the CLI and server never show a traceback for them)."""


class LlmdError(Exception):
    """Base class for errors whose message is meant for the user."""


class ModelNotFound(LlmdError):
    pass


class ModelFileError(LlmdError):
    """A model file is missing, truncated or corrupt. The message names the file and the problem."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class UnsupportedArchitecture(LlmdError):
    pass


class InvalidRequest(LlmdError):
    """A request field is invalid; `field` names it."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(message)


class QueueFull(LlmdError):
    """The waiting queue is at its cap; the server answers 429 with Retry-After."""


class EngineDead(LlmdError):
    """The engine thread stopped after an internal error."""
