"""A user's own compiled Keras model: loading it, honouring its compile, splitting its graph."""
