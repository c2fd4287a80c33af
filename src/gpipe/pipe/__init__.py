"""``gpipe.Pipe`` (``gpipe.pipe.pipe``) and the modules that cut the model, put the
Pipe together in named steps and step it, with ``gpipe.check`` built on it
(``gpipe.pipe.exactness``)."""

from gpipe.pipe.pipe import Pipe

__all__ = ["Pipe"]
