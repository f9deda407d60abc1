"""``dflash chat --session FILE`` (``{"format": "dflash-chat-session", "messages": [...]}``) and transcripts."""

import json
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..atomic import atomic_file, write_json
from ..errors import InputError

FORMAT = "dflash-chat-session"
ROLES = ("system", "user", "assistant")


def read_session(path: Path) -> List[Dict[str, str]]:
    """The messages of a session file; an empty list when it does not exist yet. Raises InputError: the file is not a
    session file (names the file and the field)."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--session {path}: not readable as JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"--session {path}: not a dflash chat session (\"format\" is not {FORMAT!r})")
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise InputError(f"--session {path}: \"messages\" must be a list")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise InputError(f"--session {path}: messages[{i}] needs a role ({', '.join(ROLES)}) and a text content")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:  # JSON allows "\ud800" alone; no tokenizer takes it
            raise InputError(f"--session {path}: messages[{i}].content holds a lone surrogate (not valid Unicode)") \
                from None
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class SessionWriter:
    """Writes the ``--session`` file after every line, atomically (a kill leaves the previous file whole); a
    failure warns once and retries (``failing``)."""

    def __init__(self, path: Path, warn: Callable[[str], None]):
        self.path, self.warn, self.failing = Path(path), warn, False

    def save(self, messages: List[Dict[str, str]]) -> bool:
        """Write ``messages``; False (one warning per run of failures) when it fails."""
        try:
            write_json(self.path, {"format": FORMAT, "messages": messages}, indent=1)
        except OSError as e:  # WriteError: any errno
            if not self.failing:
                self.warn(f"warning: --session {self.path}: cannot write ({e.strerror or e}); the conversation "
                          "is kept in memory and written again after the next line")
            self.failing = True
            return False
        if self.failing:
            self.warn(f"--session {self.path}: written again")
        self.failing = False
        return True


def write_transcript(path: Path, messages: List[Dict[str, str]], meta: Optional[dict] = None) -> Path:
    """Write a transcript: JSON for ``*.json`` (``meta`` and ``messages``), else Markdown. Raises WriteError: the file
    cannot be written (any errno)."""
    if path.suffix.lower() == ".json":
        text = json.dumps({**(meta or {}), "messages": messages}, indent=2) + "\n"
    else:
        out = ["# Chat transcript\n"] + [f"- {k}: {v}" for k, v in (meta or {}).items()]
        out += [f"\n## {m['role'].capitalize()}\n\n{m['content']}" for m in messages]
        text = "\n".join(out) + "\n"
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return path
