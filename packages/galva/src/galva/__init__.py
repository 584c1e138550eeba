"""galva: the whole job end to end on this machine's resources (``galva run``) and the small stages that have no
other home (``galva corpus``, ``galva tokenizer``, ``galva generate``). Every other stage is another distribution's
command, which ``galva run`` calls as a subprocess exactly as a user would (:mod:`galva.pipeline`)."""

from __future__ import annotations

__version__ = "0.1.0"
