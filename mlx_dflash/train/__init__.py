"""Training DFlash drafters: the config, data, initialisation, loss and loop."""
