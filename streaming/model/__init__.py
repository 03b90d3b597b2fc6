"""The model layer: choosing a model, assembling and loading it, and `Model`, the handle the
generation layer receives (it never imports the top-level `lm`, which is this layer's facade).
Every module is listed in the README's Layout section."""
