"""One base class for every error a user can fix.

The CLI prints a ``SkipDecodeError`` as one line and exits 2; the Python API
raises it; the server turns it into a 400. Anything else is a bug and keeps
its traceback. Torch-free, so every layer of the package can import it.
"""

from __future__ import annotations


class SkipDecodeError(ValueError):
    """Bad input or a state the user can fix; the message says what to do."""
