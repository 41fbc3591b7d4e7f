"""tailguard.router: the core, free of wire formats: config, admission, pools, the request path, backends."""
