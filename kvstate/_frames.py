"""The pipe protocol between :class:`kvstate.process_writer.ProcessWriter`
and its writer process (:mod:`kvstate._writer_program`)."""

from __future__ import annotations

import struct

#: frame header, engine to writer: ticket, blob length, flags
FRAME = struct.Struct("<QIB")
#: answer header, writer to engine: the ticket of the last batch written, and the
#: lengths of the error message and of the codec's report that follow it
ANSWER = struct.Struct("<QII")
#: flag: the engine waits for an answer to this frame
WAIT = 1
#: flag: the last frame; the writer answers, finishes the journal and exits
CLOSE = 2
#: flag: answer only once the codec is done with this batch (its report is of it)
SETTLE = 4
