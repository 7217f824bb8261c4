"""Live numbers from the engine's own counters: the status bar and the Inference X-ray panel."""
from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import Label, Sparkline, Static

from core.types import LiveStats, Timings



def status_line(model: str, backend: str, stats: LiveStats | None, timings: Timings | None, busy: bool) -> str:
    """The status bar text, in llama.cpp's words."""
    if stats is None or timings is None:
        return f"{model} · {backend}"
    parts = []   # the numbers first, so they stay visible at 80 columns
    if timings.ttft_ms or timings.prompt_n:
        parts += [f"TTFT {timings.ttft_ms:.0f} ms",
                  f"prompt {timings.prompt_per_second:.0f} t/s" if timings.prompt_n else "prompt n/a",
                  f"eval {timings.predicted_per_second:.1f} t/s"]
    parts += [f"ctx {stats.n_past}/{stats.n_ctx or 'n/a'}", f"cache_n {stats.cache_n}"]   # n_ctx 0: not known
    if stats.cache_disk_n:
        parts.append(f"from disk {stats.cache_disk_n}")
    if busy:
        parts.append(phase_text(stats))
    parts.append(f"{model} · {backend}")
    return " | ".join(parts)


def phase_text(stats: LiveStats, queued: bool = False) -> str:
    if queued:
        return "queued"
    if stats.phase == "prefill":
        return f"prefill {stats.prefill_done}/{stats.prefill_total}"
    if stats.phase == "decode":
        return f"decode (token {len(stats.token_latencies_ms)})"
    return stats.phase


class StatusBar(Static):

    def show_no_engine(self, model: str, loading: bool, queued: bool) -> None:
        self.update(f"{model} · {'loading…' if loading else 'no model'}" + (" | queued: 1 message" if queued else ""))


class XRayPanel(Vertical):
    """Phase, per-token latency, KV block map and prefix reuse, refreshed on a timer while generating."""

    def compose(self):
        self.border_title = "Inference X-ray"
        yield Label("phase: idle", id="xray-phase", markup=False)
        yield Label("token latency (ms)", classes="xray-heading")
        yield Sparkline([], id="xray-sparkline")
        yield Label("", id="xray-latency", markup=False)
        yield Label("KV cache blocks", classes="xray-heading")
        yield Static("", id="xray-kv")
        yield Label("", id="xray-prefix", markup=False)
        yield Label("speculative: off", id="xray-spec", markup=False)
        yield Label("", id="xray-engine", markup=False)

    def show(self, stats: LiveStats | None, block_map: list[str] | None, queued: bool = False,
             speculative: str = "speculative: off", where: str = "") -> None:
        """where: what ran the generation (backend.where: engine, device, CPU kernels' variant)."""
        if stats is None:
            self.query_one("#xray-phase", Label).update("phase: no model")
            return
        self.query_one("#xray-phase", Label).update(f"phase: {phase_text(stats, queued)}")
        lat = list(stats.token_latencies_ms[-60:])
        self.query_one("#xray-sparkline", Sparkline).data = lat
        if lat:
            last, peak = lat[-1], max(lat)
            self.query_one("#xray-latency", Label).update(f"last {last:.1f} ms · max {peak:.1f} ms · n {len(stats.token_latencies_ms)}")
        else:
            self.query_one("#xray-latency", Label).update("no tokens yet")
        self.query_one("#xray-kv", Static).update(self.block_map_text(block_map))
        self.query_one("#xray-prefix", Label).update(
            f"prefix reused: {stats.cache_n} tok ({stats.cache_disk_n} from disk)\ncontext: {stats.n_past}/{stats.n_ctx or 'n/a'}")
        self.query_one("#xray-spec", Label).update(speculative)
        self.query_one("#xray-engine", Label).update(f"ran on {where}".replace(" (", "\n(") if where else "")

    def block_map_text(self, block_map: list[str] | None) -> Text:
        if not block_map:
            return Text("n/a for this backend", style="dim")
        styles = {"used": "bold blue", "shared": "bold green", "free": "dim"}
        glyphs = {"used": "█", "shared": "█", "free": "░"}
        text = Text()
        for state in block_map[:400]:
            text.append(glyphs.get(state, "?"), style=styles.get(state, ""))
        counts = {s: block_map.count(s) for s in ("used", "shared", "free")}
        text.append(f"\nused {counts['used']} · shared {counts['shared']} · free {counts['free']}")
        return text


def speculative_text(spec, backend) -> str:
    """The X-ray's speculative line: method and acceptance of the last reply (spec: SpeculativeConfig)."""
    if spec is None or spec.method == "off":
        return "speculative: off"
    if not backend.capabilities.speculative:
        return f"speculative {spec.method}\nneeds the native backend"
    stats = backend.stats
    if not stats.spec_drafted:
        return f"speculative {spec.method}\nno drafts yet"
    return (f"speculative {spec.method}\n{stats.spec_accepted}/{stats.spec_drafted} drafts accepted "
            f"({100 * stats.spec_accepted / stats.spec_drafted:.0f}%)")
