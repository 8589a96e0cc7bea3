"""The supervisor as a child subreaper, and how often the watch re-reads the attempt's tree."""

from __future__ import annotations

import multiprocessing as mp

from supervisor.launch import subreaper


def _in_a_child(out) -> None:
    before = (subreaper.is_subreaper(), subreaper.tree_refresh_s())
    took = subreaper.become_subreaper()
    out.put((before, took, subreaper.is_subreaper(), subreaper.tree_refresh_s()))


def test_the_tree_is_read_seldom_only_where_orphans_come_back():
    """A subreaper gets the orphans of its tree back, so a read every 10 s is enough; without
    it (prctl not granted) an orphan goes to init and the watch keeps reading every 2 s. Run in
    a child process: the mark lasts the process's life."""
    out = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_in_a_child, args=(out,))
    child.start()
    before, took, after, refresh = out.get(timeout=30)
    child.join(30)
    assert before == (False, subreaper.REFRESH_TREE_NO_REAPER_S) or before[0]  # pytest's own
    assert took and after and refresh == subreaper.REFRESH_TREE_S
