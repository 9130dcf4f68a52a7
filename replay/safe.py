"""Journal strings on a terminal: shown, never obeyed.

A request id, a store key or an error string in a journal can hold anything,
escape sequences included (clear the screen, set the window title, recolour
every later line). Rich prints markup-free :class:`~rich.text.Text`
literally but passes ESC through. Every string from a journal goes through
:func:`printable` before it reaches a renderable, so it is shown escaped,
the way Python's ``repr`` would write it.
"""

from __future__ import annotations

from rich.text import Text


def printable(value: object) -> str:
    """``value`` as text with every control or invisible character escaped."""
    text = "" if value is None else str(value)
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def literal(value: object, style: str = "") -> Text:
    """A rich Text that shows ``value`` literally: no markup, no control characters."""
    return Text(printable(value), style=style)
