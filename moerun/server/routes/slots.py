"""llama-server's slots: /slots lists them; /slots/{id}?action=erase frees an idle slot's KV cache, save and
restore write it to and read it from a file inside --slot-save-path."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from moerun.server.errors import APIError

if TYPE_CHECKING:
    from moerun.server.state import Server

SLOT_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def slot_file(folder: Path | None, name: str | None) -> Path:
    """The file a slot action names: a plain file name inside --slot-save-path (no folders, no '..')."""
    if folder is None:
        raise APIError(400, "slot files are off: start the server with --slot-save-path DIR", param="action")
    if not isinstance(name, str) or not SLOT_FILE.fullmatch(name) or ".." in name:
        raise APIError(400, "filename must be a plain file name (letters, digits, '.', '_', '-'; no folders)",
                       param="filename")
    return Path(folder) / name


async def _filename(http: HTTPRequest, given: str | None) -> str | None:
    """llama-server takes {"filename": ...} in the body; a query parameter works too."""
    if given is not None:
        return given
    raw = await http.body()
    if not raw.strip():
        return None
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        raise APIError(400, "the body is not valid JSON") from None
    return body.get("filename") if isinstance(body, dict) else None


def add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/slots")
    async def slots():
        ready = server.require()
        n_ctx = ready.runtime.engine.ctx_size
        return [{"id": s.index, "is_processing": s.req is not None, "n_ctx": n_ctx, "n_tokens": s.kv.length,
                 "n_blocks": len(s.kv.blocks), "id_task": None if s.req is None else s.req.id}
                for s in ready.scheduler.slots]

    @app.post("/slots/{index}")
    async def slot_action(index: int, action: str, http: HTTPRequest, filename: str | None = None):
        """llama-server's slot actions: `erase` (free an idle slot's KV cache), `save` and `restore` (its cache
        to and from a file named by `filename`, in the body or the query, inside --slot-save-path)."""
        from moerun.engine import slotfile
        from moerun.engine.scheduler import ModelUnavailableError, SlotBusyError

        ready = server.require()
        if action not in ("erase", "save", "restore"):
            raise APIError(400, f"action {action!r} is not supported (erase, save, restore)", param="action")
        if action == "erase":
            op, path = ready.scheduler.erase, None
        else:
            path = slot_file(server.cfg.slot_save_path, await _filename(http, filename))
            if action == "restore" and not path.is_file():
                raise APIError(404, f"no slot file {path.name!r}", param="filename")
            ctx = ready.runtime.engine.ctx_size

            def op(i):
                return ready.scheduler.slot_op(i, (lambda s: slotfile.save(s.seq, path)) if action == "save"
                                               else (lambda s: slotfile.restore(s.seq, path, ctx)))
        t0 = time.perf_counter()
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(op(index)), timeout=600)
        except IndexError as e:
            raise APIError(404, str(e)) from None
        except SlotBusyError as e:
            raise APIError(409, str(e)) from None
        except ModelUnavailableError as e:
            raise APIError(503, str(e), "unavailable_error") from None
        except slotfile.SlotFileError as e:
            raise APIError(400, str(e), param="filename") from None
        except OSError as e:
            raise APIError(500, f"the slot file could not be written or read: {e.strerror}") from None
        ms = {"save_ms" if action == "save" else "restore_ms": round((time.perf_counter() - t0) * 1e3, 3)}
        if action == "erase":
            return {"id_slot": index, "n_erased": result}
        n, nbytes = result
        if action == "save":
            return {"id_slot": index, "filename": path.name, "n_saved": n, "n_written": nbytes, "timings": ms}
        return {"id_slot": index, "filename": path.name, "n_restored": n, "n_read": nbytes, "timings": ms}
