"""``kvalloc top``: the Textual app that watches live pools through their statistics segments.

Shape (memray's live TUI is the model): one App, a Screen of small panels, snapshots taken on a
worker thread and posted back as messages, keys in the footer. The app only reads segments: it
never signals or writes to the engine.
"""

from __future__ import annotations

import dataclasses
import reprlib
from pathlib import Path

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.message import Message
from textual.timer import Timer

from pykvalloc.errors import SegmentError
from pykvalloc.stats import SegmentFile, Snapshot

from . import render
from .screens import HelpScreen, PickerScreen, PoolScreen
from .watch import PoolWatch, live_segments, named

# Refresh intervals that + and - step through, in seconds: + refreshes more often (a shorter
# interval), - less often; the footer shows the interval in force next to the two keys.
INTERVALS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def interval_group(interval: float) -> Binding.Group:
    """The footer's label of the + and - keys: the refresh interval in force."""
    return Binding.Group(f"↻ {interval:g} s")


class Sampled(Message):
    """A snapshot of ``pool`` (or the error that took its place), from the sampling thread."""

    def __init__(self, pool: PoolWatch, snapshot: Snapshot | None,
                 error: SegmentError | None) -> None:
        super().__init__()
        self.pool = pool
        self.snapshot = snapshot
        self.error = error


class KvallocTop(App[None]):
    """Watches one pool at a time; tab moves to the next live one. ``wanted`` (a pid or a pool
    name) is the pool asked for by name: waited for while no live pool has it, and watched
    again when its engine exits and a pool of that name starts (a restarted engine)."""

    TITLE = "kvalloc top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
        Binding("space", "toggle_pause", "Pause"),
        Binding("plus", "faster", "Faster", key_display="+", group=interval_group(1.0)),
        Binding("minus", "slower", "Slower", key_display="-", group=interval_group(1.0)),
        Binding("tab", "next_pool", "Next pool", priority=True),
        Binding("p", "pick_pool", "Pools"),
        Binding("v", "toggle_view", "Pool view"),
        # Said in the sequences panel's title and the help: the footer has no room left.
        Binding("up", "select_sequence(-1)", "Sequence", show=False),
        Binding("down", "select_sequence(1)", "Sequence", show=False),
        Binding("question_mark,f1", "help", "Help", key_display="?"),
    ]

    def __init__(self, target: SegmentFile | None = None, interval: float = 1.0,
                 wanted: str | None = None) -> None:
        super().__init__()
        self.target = target
        self.wanted = wanted
        self.interval = min(INTERVALS, key=lambda step: abs(step - interval))
        self.paused = False
        self.kv_page = True  # a KV cache's pool shows its KV page first (v: the pool's)
        self._keys_shown: tuple[bool | None, ...] = ()  # check_action's answers, last redraw
        self.pools: dict[Path, PoolWatch] = {}
        self.current: PoolWatch | None = None
        self.pool_screen = PoolScreen()
        self._timer: Timer | None = None
        self._sampling = False
        self._picking = False
        self._listing_error: str | None = None  # the latest, notified once
        self._waited = False  # started with no live pool: the first ones to appear are offered
        self._offered_wanted = False  # several live pools had the wanted name: offered once
        self._label_interval()

    # -- lifetime ---------------------------------------------------------------------------

    def on_mount(self) -> None:
        self.push_screen(self.pool_screen)
        self._timer = self.set_interval(self.interval, self.tick)
        if self.target is not None:
            self.switch_to(self.target)
        elif self.wanted is not None:
            self._adopt_the_wanted_pool()
        else:
            self._adopt_a_live_pool(offer_picker=True)
            self._waited = self.current is None and not self._picking

    def on_unmount(self) -> None:
        for pool in self.pools.values():
            pool.close()

    # -- sampling ---------------------------------------------------------------------------

    def tick(self) -> None:
        """Starts one snapshot of the current pool unless paused, done, not due or one is under
        way. An ended pool whose path a new pool took is watched afresh."""
        if self.current is None and self.wanted is not None:
            self._adopt_the_wanted_pool()
        elif self.current is None:
            # Waiting for a pool: the only one to appear is watched; several appearing at once
            # are offered once, as at start.
            self._adopt_a_live_pool(offer_picker=self._waited)
            if self.current is not None or self._picking:
                self._waited = False
        elif self.current.replaced():
            self.switch_to(self.current.file)
            return  # switch_to ticks
        elif self.current.ended and self.wanted is not None:
            if self._adopt_the_wanted_pool():
                return  # switch_to ticks
        pool = self.current
        if self.paused or pool is None or not pool.due() or self._sampling:
            return
        self._sampling = True
        self._sample(pool)

    @work(thread=True, group="sample")
    def _sample(self, pool: PoolWatch) -> None:
        snapshot, error = None, None
        try:
            snapshot = pool.take()
        except SegmentError as exc:
            error = exc
        if snapshot is not None or error is not None:  # neither: the app closed it, exiting
            self.post_message(Sampled(pool, snapshot, error))

    def on_sampled(self, message: Sampled) -> None:
        self._sampling = False
        message.pool.record(message.snapshot, message.error)
        if message.pool is self.current:
            self.redraw()

    def redraw(self) -> None:
        if self.current is not None:
            self.pool_screen.show(self.current, self.paused, self.interval)
        shown = (self._kv_shown(), self.check_action("toggle_view", ()))
        if shown != self._keys_shown:  # the footer is drawn again only when its keys change
            self._keys_shown = shown
            self.refresh_bindings()

    # -- pools ------------------------------------------------------------------------------

    def switch_to(self, found: SegmentFile) -> None:
        """Watches ``found`` from now on (its history is kept if it was watched before, unless
        a new pool has taken its path since)."""
        pool = self.pools.get(found.path)
        if pool is not None and pool.replaced():
            pool.close()
            pool = None
        if pool is None:
            pool = self.pools[found.path] = PoolWatch(found)
        self.current = pool
        self.redraw()
        self.tick()

    def _live_segments(self, asked: bool) -> list[SegmentFile] | None:
        """``live_segments()``, or None when the segment directory cannot be listed: then a
        notification says why, when a key ``asked`` or the error is new (without a pool this
        runs at every tick)."""
        try:
            live = live_segments()
        except SegmentError as exc:
            if asked or str(exc) != self._listing_error:
                self.notify(str(exc), title="cannot list pools", severity="error")
            self._listing_error = str(exc)
            return None
        self._listing_error = None
        return live

    def _adopt_a_live_pool(self, offer_picker: bool) -> None:
        # With no pool chosen: take the only live one, or (at start) offer the live ones. A
        # picker dismissed without a choice is not offered again until p is pressed.
        live = self._live_segments(asked=False)
        if live is None:
            return
        if len(live) == 1:
            self.switch_to(live[0])
        elif live and offer_picker:
            self.action_pick_pool(live)

    def _adopt_the_wanted_pool(self) -> bool:
        """Watches the live pool that ``wanted`` names, if one does now (other than the one
        that ended); several are offered once. Whether one was taken."""
        assert self.wanted is not None
        live = self._live_segments(asked=False)
        if live is None:
            return False
        ended = self.current.file if self.current is not None else None
        found = [segment for segment in named(self.wanted, live) if segment != ended]
        if len(found) == 1:
            self.switch_to(found[0])
            return True
        if found and not self._offered_wanted:
            self._offered_wanted = True
            self.action_pick_pool(found)
        return False

    def waiting_for(self) -> str:
        """What the screen says it waits for while it watches no pool."""
        if self.wanted is None:
            return "a pool to publish (a named pool does)"
        return f"pool {reprlib.repr(self.wanted)} to publish"

    def action_next_pool(self) -> None:
        if self.screen is not self.pool_screen:
            return
        live = self._live_segments(asked=True)
        if live is None:
            return
        if self.current is not None and self.current.file not in live:
            live = sorted([*live, self.current.file], key=lambda f: (f.pid, f.name))
        if not live:
            self.notify("no live pools", severity="warning")
            return
        if self.current is None:
            self.switch_to(live[0])
            return
        index = live.index(self.current.file)
        following = live[(index + 1) % len(live)]
        if following == self.current.file:
            self.notify("this is the only live pool")
        self.switch_to(following)

    def action_pick_pool(self, live: list[SegmentFile] | None = None) -> None:
        if self._picking:
            return
        segments = live if live is not None else self._live_segments(asked=True)
        if segments is None:
            return
        if not segments:
            self.notify("no live pools", severity="warning")
            return
        self._picking = True

        def chosen(path: Path | None) -> None:
            self._picking = False
            found = next((s for s in segments if s.path == path), None)
            if found is not None:
                self.switch_to(found)

        self.push_screen(PickerScreen(segments), chosen)

    # -- refresh control --------------------------------------------------------------------

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        if self._timer is not None:
            self._timer.pause() if self.paused else self._timer.resume()
        self.redraw()

    def action_slower(self) -> None:
        self._set_interval(+1)

    def action_faster(self) -> None:
        self._set_interval(-1)

    def _set_interval(self, step: int) -> None:
        index = INTERVALS.index(self.interval)
        self.interval = INTERVALS[max(0, min(len(INTERVALS) - 1, index + step))]
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_interval(self.interval, self.tick, pause=self.paused)
        self._label_interval()
        self.refresh_bindings()
        self.redraw()

    def _label_interval(self) -> None:
        # A binding is frozen: the two keys are bound again, labelled with the new interval.
        group = interval_group(self.interval)
        for key in ("plus", "minus"):
            self._bindings.key_to_bindings[key] = [
                dataclasses.replace(binding, group=group)
                for binding in self._bindings.key_to_bindings.get(key, [])]

    # -- the KV cache's page ----------------------------------------------------------------

    def _kv_shown(self) -> bool:
        """Whether the current pool has a KV cache, and its panels show."""
        snap = self.current.last if self.current is not None else None
        return (snap is not None and snap.kv is not None
                and (self.kv_page or self.pool_screen.all_shown))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # The view and selection keys show in the footer only where they do something.
        if action == "toggle_view":
            snap = self.current.last if self.current is not None else None
            return (snap is not None and snap.kv is not None
                    and not self.pool_screen.all_shown)
        if action == "select_sequence":
            return self._kv_shown()
        return True

    def action_toggle_view(self) -> None:
        self.kv_page = not self.kv_page
        self._label_view()
        self.redraw()

    def action_select_sequence(self, step: int) -> None:
        pool = self.current
        snap = pool.last if pool is not None else None
        if pool is None or snap is None or snap.kv_sequences is None:
            return
        entries = snap.kv_sequences.entries
        chosen = render.selected_entry(snap, pool.selected_sequence)
        if chosen is None:
            return
        at = max(0, min(len(entries) - 1, entries.index(chosen) + step))
        pool.selected_sequence = entries[at].handle
        self.redraw()

    def _label_view(self) -> None:
        # As for the interval: the binding is bound again with the page v turns to.
        label = "Pool view" if self.kv_page else "KV view"
        self._bindings.key_to_bindings["v"] = [
            dataclasses.replace(binding, description=label)
            for binding in self._bindings.key_to_bindings.get("v", [])]
        self.refresh_bindings()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())
