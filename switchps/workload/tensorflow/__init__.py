"""The TensorFlow/Keras framework: its model zoo, flat weights, gradient computer, scoring and ``.keras`` files."""
