"""Token reduction: which patch tokens of an image the encoder reads (most of a formula image is white
paper). The policy is computed from the preprocessed image alone, on the host, in numpy: the graphs
only gather the kept indices."""
