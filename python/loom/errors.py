"""loom's errors: LoomError and a subclass per kind of failure.

Every error from the library carries loom's own message (what is wrong and
what to do) and its status code; the Python layer raises the same classes
for bad input it finds itself, before calling into the library.
"""


class LoomError(Exception):
    """An error from loom. `status` is the library's loom_status (0 when the
    Python layer found the problem)."""

    def __init__(self, message, status=0):
        super().__init__(message)
        self.status = status


class InvalidArgumentError(LoomError, ValueError):
    """Something passed cannot be used (a wrong type, value or id)."""


class LoomIOError(LoomError, OSError):
    """A file could not be opened, read or written."""


class FormatError(LoomError, ValueError):
    """A file's contents are malformed."""


class ConfigError(LoomError, ValueError):
    """A configuration is missing a field or has a bad value."""


class UnsupportedError(LoomError, NotImplementedError):
    """Well-formed, but not something loom implements."""


class ShapeError(LoomError, ValueError):
    """Shapes or sizes do not agree."""


class NotFoundError(LoomError, LookupError):
    """A named model, tensor, file or key does not exist."""


class OutOfMemoryError(LoomError, MemoryError):
    """An allocation failed (host or device)."""


class DeviceError(LoomError, RuntimeError):
    """A CUDA, cuBLASLt or cuDNN error."""


class CommError(LoomError, RuntimeError):
    """A collective failed or timed out, or a remote rank died."""


class MeshError(ConfigError):
    """A device mesh that does not fit the world or the model."""


class InternalError(LoomError, RuntimeError):
    """A broken invariant inside loom: a bug worth reporting."""


_BY_STATUS = {1: InvalidArgumentError, 2: LoomIOError, 3: FormatError, 4: ConfigError,
              5: UnsupportedError, 6: ShapeError, 7: NotFoundError, 8: OutOfMemoryError,
              9: DeviceError, 10: CommError, 11: InternalError}


def error_for(status):
    return _BY_STATUS.get(status, LoomError)
