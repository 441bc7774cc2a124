"""Model factories: `name(input_shape, num_classes, **options) -> torch.nn.Module`."""
