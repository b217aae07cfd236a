"""Where benchmark scripts put their JSON."""

import json
import pathlib


def write_json(path: str, result: dict) -> None:
    """Write ``result`` as indented JSON to ``path`` (folders made) and say so."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
