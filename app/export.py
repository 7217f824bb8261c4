"""`kvchat export ID --format md|json`: print one conversation from the chat history."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.errors import BadInputError


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="print a conversation from the chat history as Markdown or JSON")
    p.add_argument("id", type=int, help="conversation id (shown in the chat's sidebar as #ID)")
    p.add_argument("--format", choices=("md", "json"), default="md", help="output format (default: md)")
    p.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    p.add_argument("--db", default=None, help="history database (default: the user data dir's history.sqlite3)")
    return p


def cmd_export(args) -> int:
    from core.history import History, default_path
    path = Path(args.db) if args.db else default_path()
    if not path.exists():
        raise BadInputError(f"no chat history at {path}")
    history = History(path)
    try:
        text = history.export_conversation(args.id, args.format)
    finally:
        history.close()
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    else:
        sys.stdout.write(text + "\n")
    return 0
