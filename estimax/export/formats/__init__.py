"""A published version in other formats: a TensorFlow SavedModel (``savedmodel``, with the
preprocessing in TF ops: ``tf_preprocess``) and an ONNX model (``onnx_export``, translated from
StableHLO op by op: ``stablehlo_onnx``); ``common`` is what both read (the export, its names,
its check inputs, the comparison). Each imports its own heavy library (TensorFlow, onnx) only
when run."""
