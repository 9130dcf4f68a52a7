"""The terminal inspector (``kvstate inspect``), a textual app; needs the
``tui`` extra. Nothing outside this package imports textual."""
