"""Journal strings on a terminal: shown, never obeyed.

A request id, a store key or an error string in a journal can hold anything,
escape sequences included (clear the screen, set the window title, recolour
every later line). Rich prints markup-free :class:`~rich.text.Text`
literally but passes ESC through. Every string from a journal goes through
:func:`printable` before it reaches a renderable, so it is shown escaped,
the way Python's ``repr`` would write it, and cut to a length a terminal can
show.
"""

from __future__ import annotations

from rich.text import Text

#: characters of one journal value shown on a terminal; ``--json`` has them all
SHOWN = 2_000


def printable(value: object) -> str:
    """``value`` as text with every control or invisible character escaped, cut
    to :data:`SHOWN` characters (a multi-megabyte request id would otherwise
    make the report's layout work grow with its square)."""
    text = "" if value is None else str(value)
    more = len(text) - SHOWN
    if more > 0:
        text = text[:SHOWN]
    if not text.isprintable():
        text = "".join(
            c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
        )
    return text if more <= 0 else f"{text}... ({more:,} more characters; --json has them all)"


def literal(value: object, style: str = "") -> Text:
    """A rich Text that shows ``value`` literally: no markup, no control characters."""
    return Text(printable(value), style=style)
