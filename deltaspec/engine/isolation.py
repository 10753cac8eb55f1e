"""One request's failure stays its own: a batched step of the update that raises is retried one sequence at a
time, and a sequence that fails alone ends with an error while the others go on. (A forward pass that raises
is handled by the scheduler's quarantine: see `deltaspec.engine.scheduler`.)"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from deltaspec.errors import RequestError

log = logging.getLogger("deltaspec.engine")

Item = TypeVar("Item")
Result = TypeVar("Result")


def each_or_alone(
    items: list[Item], run: Callable[[list[Item]], list[Result]], fail: Callable[[Item, BaseException], None]
) -> list[Result | None]:
    """`run(items)`, one result per item; when it raises, each item runs alone, and one that fails alone goes to
    `fail` and gets None. `run` must change nothing it would redo when it raises."""
    if not items:
        return []
    try:
        return run(items)
    except RequestError as exc:  # a request's own doing: no traceback
        log.warning("a batched step over %d sequences failed (%s); retrying one at a time", len(items), exc)
    except Exception:  # noqa: BLE001 - find the item at fault
        log.exception("a batched step over %d sequences failed; retrying one at a time", len(items))
    results: list[Result | None] = []
    for item in items:
        try:
            results.append(run([item])[0])
        except RequestError as exc:
            log.warning("a request failed while generating: %s", exc)
            fail(item, exc)
            results.append(None)
        except Exception as exc:  # noqa: BLE001 - this item alone fails
            log.exception("a sequence failed on its own")
            fail(item, exc)
            results.append(None)
    return results


def guarded(item: Item, action: Callable[[], None], fail: Callable[[Item, BaseException], None]) -> None:
    """Run one sequence's `action`; if it raises, that sequence fails."""
    try:
        action()
    except RequestError as exc:  # the request's own doing (its constraint gave out): no traceback
        log.warning("a request failed while generating: %s", exc)
        fail(item, exc)
    except Exception as exc:  # noqa: BLE001 - this sequence alone fails
        log.exception("a sequence failed while its tokens were appended")
        fail(item, exc)
