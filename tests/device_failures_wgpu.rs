//! A task that fails on the device's runner thread (here a bf16 cast on an adapter without bf16) is only
//! logged by CubeCL, and the caller reads values nothing computed. `qarl::device_failures` counts those
//! log events, so that no result is written after one; a probe that expects the failure (does this device
//! have bf16?) does not count. The count is process-wide, so this file holds one test (its own process).
//!
//! Runs on whatever adapter wgpu finds; skips with a message when there is none, unless
//! `QARL_REQUIRE_WGPU=1`. On an adapter with bf16 only the probe's half runs.
#![cfg(feature = "wgpu")]

mod common;

use burn::tensor::{DType, Tensor};
use qarl::device_failures::{self, DeviceFailureLayer};
use qarl::model::Activations;
use qarl::ops::BackendKind;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

#[test]
fn a_failed_device_task_stops_every_write_and_a_probe_does_not() {
    if !common::wgpu_available() {
        return;
    }
    tracing_subscriber::registry()
        .with(DeviceFailureLayer::default())
        .init();
    let device = BackendKind::Wgpu.device().unwrap();
    let has_bf16 = Activations::Bf16.check_device(&device).is_ok();
    assert_eq!(
        device_failures::unexpected_failures(),
        0,
        "the probe counted"
    );
    device_failures::check().unwrap();
    if has_bf16 {
        eprintln!("this adapter has bf16: no failure to provoke");
        return;
    }
    // The same cast without the probe: CubeCL logs the panic and hands back values nothing computed.
    let x = Tensor::<2>::ones([2, 2], &device).cast(DType::BF16);
    let _ = qarl::host::to_f32_vec(x.cast(DType::F32));
    assert!(device_failures::unexpected_failures() > 0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.json");
    let err = format!("{:#}", qarl::io::write_json_atomic(&path, &1).unwrap_err());
    assert!(
        err.contains("out.json: not written") && err.contains("failed task"),
        "{err}"
    );
    assert!(!path.exists());
}
