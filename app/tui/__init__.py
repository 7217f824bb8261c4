"""kvchat's Textual TUI: `app.py` (the App and `run_tui`), `screens/` (modal screens), `widgets/`."""
