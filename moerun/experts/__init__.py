"""Routed experts: where they live, which ones are kept hot, and how well that works.

The tensor-free pieces (usable and testable without torch):

- `policy`: eviction policies behind one small interface (`Policy`: LRU, LFU, LFRU (the runtime's default), ARC),
  `make_policy(name)`, and `SlotTable`, the bookkeeping of which expert sits in which slot of
  one layer's cache (hits, loads, evictions of one step, with the step's experts pinned).
- `stats`: `CacheStats`, counters per (layer, phase) and the summary lines the CLI prints.
- `trace`: routing traces (JSON Lines) written during a run, read back, and replayed offline
  against any policy or Belady's optimal (`simulate`, `belady`).
- `simulate_cli`: `moerun trace simulate FILE --slots 4,8 --policy lru,belady`.

The tensor side (home-tier store, device slots, copy stream, prefetch) builds on these.
"""
