//! Run-time device selection: `auto`, `cpu`, `cuda[:N]`, `metal`.

use candle_core::Device;

use crate::{Error, Result};

/// A device request, as given to `--device`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceChoice {
    /// CUDA if built with it and available, else Metal likewise, else CPU.
    Auto,
    /// The CPU.
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
    /// The Metal device.
    Metal,
}

impl std::str::FromStr for DeviceChoice {
    type Err = Error;

    fn from_str(value: &str) -> Result<Self> {
        let bad = |reason: &str| Error::Device {
            requested: value.to_string(),
            reason: reason.to_string(),
        };
        match value {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "metal" => Ok(DeviceChoice::Metal),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(ordinal) => ordinal
                    .parse()
                    .map(DeviceChoice::Cuda)
                    .map_err(|_| bad("expected cuda:<ordinal>")),
                None => Err(bad("expected auto, cpu, cuda, cuda:N or metal")),
            },
        }
    }
}

impl DeviceChoice {
    /// The candle device for this choice.
    pub fn device(&self) -> Result<Device> {
        let unavailable = |what: &str, e: candle_core::Error| Error::Device {
            requested: what.to_string(),
            reason: format!(
                "{e} (was fluxmem built with `--features {}`?)",
                what.split(':').next().unwrap_or(what)
            ),
        };
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda(ordinal) => {
                Device::new_cuda(*ordinal).map_err(|e| unavailable(&format!("cuda:{ordinal}"), e))
            }
            DeviceChoice::Metal => Device::new_metal(0).map_err(|e| unavailable("metal", e)),
            DeviceChoice::Auto => {
                if candle_core::utils::cuda_is_available() {
                    if let Ok(device) = Device::new_cuda(0) {
                        return Ok(device);
                    }
                }
                if candle_core::utils::metal_is_available() {
                    if let Ok(device) = Device::new_metal(0) {
                        return Ok(device);
                    }
                }
                Ok(Device::Cpu)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_choices() {
        assert_eq!("auto".parse::<DeviceChoice>().unwrap(), DeviceChoice::Auto);
        assert_eq!(
            "cuda:3".parse::<DeviceChoice>().unwrap(),
            DeviceChoice::Cuda(3)
        );
        assert_eq!(
            "cuda".parse::<DeviceChoice>().unwrap(),
            DeviceChoice::Cuda(0)
        );
        assert!("tpu".parse::<DeviceChoice>().is_err());
        assert!("cuda:x".parse::<DeviceChoice>().is_err());
        assert!(matches!(DeviceChoice::Cpu.device().unwrap(), Device::Cpu));
        assert!(
            matches!(DeviceChoice::Auto.device().unwrap(), Device::Cpu)
                || cfg!(any(feature = "cuda", feature = "metal"))
        );
    }
}
