"""What every benchmark shares, one copy each; a driver imports only this and the product.

- ``procs``: free ports, starting the simulator and tailguard, readiness, stopping, /proc readings;
- ``client``: the lean HTTP/1.1 clients, httptools underneath (keep-alive, pooled, SSE-counting);
- ``config``, ``toml``: generated tailguard config files, as tables one writer turns into TOML;
- ``clocks``: CPU clocks of the processes under test, the client and the machine;
- ``report``: JSON results, markdown tables and the code version;
- ``cli``: ``main()``'s Trio run with Ctrl-C handling.

The traffic mix, traces and percentiles are the product's own
(``tailguard.server.advise.replay``), since ``tailguard advise`` needs them too.
"""
