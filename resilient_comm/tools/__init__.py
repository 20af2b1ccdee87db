"""The commands built on the library: `resilient-comm` (cli) and what it runs (demo, doctor,
chaos, bench). The library never imports them."""
