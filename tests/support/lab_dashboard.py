"""What a user sees of the dashboard in JupyterLab, measured from the DOM.

`install_recorder(page)` watches the page: each change of the last dashboard's
table (the steps per rank), of its live curves (the step their data is of, from the
grid's class, with the lines drawn) and of its picture of the last step's panels (the
step it shows, from its class) is noted with the page's clock. `figures(events, ...)`
turns the notes of one cell into the issue's numbers, for the curves or the picture:
the first frame after the first step, updates per second, how far it lags the table
(in steps and seconds), the final frame after the cell's end.
"""

from __future__ import annotations

import re

RECORDER = r"""() => {
  if (window.__nbtrain) return;
  window.__nbtrain = [];
  const seen = {table: null, img: null, live: null};
  const record = () => {
    const boards = [...document.querySelectorAll('.widget-vbox')].filter(
      b => b.querySelector('table') && b.innerText.includes('step time'));
    const board = boards[boards.length - 1];
    if (!board) return;
    const t = performance.now();
    const table = board.querySelector('table');
    if (table && table.innerText !== seen.table) {
      seen.table = table.innerText;
      const steps = [...table.querySelectorAll('tr')].slice(1).map(r => Number(r.cells[1].innerText));
      window.__nbtrain.push({t, kind: 'table', board: boards.length, steps});
    }
    const live = board.querySelector('.nbtrain-live');
    const lines = live ? live.querySelectorAll('path.line').length : 0;
    if (live && lines && live.className !== seen.live) {
      seen.live = live.className;
      const m = /nbtrain-live-step-(\d+)/.exec(live.className);
      window.__nbtrain.push({t, kind: 'live', board: boards.length,
                             step: m ? Number(m[1]) : null, empty: false, lines});
    }
    const img = board.querySelector('img');
    const key = img ? img.src + ' ' + img.className : null;
    if (img && key !== seen.img) {
      seen.img = key;
      const m = /nbtrain-step-(\d+)/.exec(img.className || '');
      window.__nbtrain.push({t, kind: 'picture', board: boards.length,
                             step: m ? Number(m[1]) : null, empty: !img.src || img.src.length < 40});
    }
  };
  new MutationObserver(record).observe(document.body,
    {subtree: true, childList: true, attributes: true, characterData: true});
}"""


def install_recorder(page) -> None:
    page.evaluate(RECORDER)


def now_ms(page) -> float:
    return page.evaluate("() => performance.now()")


def events(page, since_ms: float = 0.0) -> list[dict]:
    return [e for e in page.evaluate("() => window.__nbtrain") if e["t"] >= since_ms]


def figures(notes: list[dict], began_ms: float, ended_ms: float, kind: str = "live") -> dict:
    """The numbers of one training cell, from its notes (times in ms of the page), for
    the live curves (`kind="live"`) or the picture ("picture")."""
    tables = [e for e in notes if e["kind"] == "table" and e["steps"]]
    pictures = [e for e in notes if e["kind"] == kind and not e["empty"]]
    first_step = next((e["t"] for e in tables if max(e["steps"]) >= 1), None)
    out = {
        "cell_s": (ended_ms - began_ms) / 1e3,
        "table_updates": len(tables),
        "picture_updates": len(pictures),
        "first_step_s": None if first_step is None else (first_step - began_ms) / 1e3,
        "first_frame_after_first_step_s": None,
        "pictures_per_s": None,
        "pictures_during": 0,  # updates between the first step and the cell's end
        "span_s": None,  # that time, seconds
        "max_lag_steps": None,
        "max_lag_s": None,
        "final_frame_after_end_s": None,
    }
    if first_step is None or not pictures:
        return out
    during = [p for p in pictures if p["t"] >= first_step]
    if during:
        out["first_frame_after_first_step_s"] = (during[0]["t"] - first_step) / 1e3
        span = (ended_ms - first_step) / 1e3
        out["pictures_during"] = len([p for p in during if p["t"] <= ended_ms])
        out["span_s"] = span
        out["pictures_per_s"] = out["pictures_during"] / max(span, 1e-3)
    # Lag: at each table update, the table's newest step against the picture shown then,
    # and how long ago the table first showed the picture's step.
    lag_steps, lag_s = 0, 0.0
    for tab in tables:
        if tab["t"] < first_step or tab["t"] > ended_ms:
            continue
        shown = [p for p in pictures if p["t"] <= tab["t"] and p["step"] is not None]
        pic_step = shown[-1]["step"] if shown else 0
        lag_steps = max(lag_steps, max(tab["steps"]) - pic_step)
        newer = next((t for t in tables if max(t["steps"]) > pic_step), None)
        if newer is not None and newer["t"] <= tab["t"]:
            lag_s = max(lag_s, (tab["t"] - newer["t"]) / 1e3)
    out["max_lag_steps"], out["max_lag_s"] = lag_steps, lag_s
    last_step = max(max(t["steps"]) for t in tables)
    final = next((p for p in pictures if p["step"] is not None and p["step"] >= last_step), None)
    if final is not None:
        out["final_frame_after_end_s"] = (final["t"] - ended_ms) / 1e3
    return out


def wait_final_frame(page, began_ms: float, ended_ms: float, timeout_s: float = 60.0) -> dict:
    """Wait until the curves and the picture show the cell's last step (on a loaded
    machine a picture takes seconds); the cell's figures then, {"live": ..., "picture":
    ...}."""
    deadline = now_ms(page) + timeout_s * 1e3
    while True:
        notes = events(page, began_ms)
        found = {kind: figures(notes, began_ms, ended_ms, kind) for kind in ("live", "picture")}
        done = all(f["final_frame_after_end_s"] is not None for f in found.values())
        if done or now_ms(page) > deadline:
            return found
        page.wait_for_timeout(250)


def steps_in(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"(\d+)/\d+ \[", text)]
