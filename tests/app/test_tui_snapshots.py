"""Snapshots of the main screen, the settings screen and the X-ray panel, taken before any
generation on a database with fixed contents, so that no live number or time is in them."""
from app.tui.app import KvChatApp
from core.types import SamplingParams


def make_app(engine, db) -> KvChatApp:
    app = KvChatApp(engine=engine, db_path=db)
    app.params = SamplingParams(temperature=0.7, max_tokens=256, seed=7)
    return app


def test_main_screen(engine, fixed_db, snap_compare):
    assert snap_compare(make_app(engine, fixed_db), terminal_size=(80, 24))


def test_main_screen_light_theme_wide(engine, fixed_db, snap_compare):
    assert snap_compare(make_app(engine, fixed_db), press=["f10"], terminal_size=(110, 30))


def test_settings_screen(engine, fixed_db, snap_compare):
    async def bad_value(pilot):
        await pilot.press("f4")
        await pilot.pause()
        pilot.app.screen.query_one("#set-top_p").value = "1.5"
        await pilot.press("ctrl+s")
        await pilot.pause()
    assert snap_compare(make_app(engine, fixed_db), run_before=bad_value, terminal_size=(80, 24))


def test_xray_panel(engine, fixed_db, snap_compare):
    assert snap_compare(make_app(engine, fixed_db), press=["ctrl+t"], terminal_size=(100, 30))


def test_help_screen(engine, fixed_db, snap_compare):
    assert snap_compare(make_app(engine, fixed_db), press=["f1"], terminal_size=(80, 24))
