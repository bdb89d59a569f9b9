"""The scalar features the calibration head reads beside a drafted position's hidden state:
the drafter's top-1 probability, its entropy, and the position j / CALIBRATION_POSITIONS.
Computed in torch by the fused drafters (calibration.CalibrationHead.scalar_features) and in
numpy by the remote one (onnx_runtime), so the constant lives apart from both, free of torch."""

CALIBRATION_POSITIONS = 8  # the position feature is j / CALIBRATION_POSITIONS
