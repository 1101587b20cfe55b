//! The `engines` string (vlmcontext's `engines` property): pure parsing with no llama.cpp or
//! crate types, so `fuzz/` includes this file as it is. [`crate::EngineConfig::parse_list`] maps
//! each [`EngineSpec`] onto an engine configuration.

/// Core ids go up to this, excluded (glibc's `CPU_SETSIZE`: what `sched_setaffinity` can name).
pub const MAX_CORES: usize = 1024;
/// Most threads an engine may be given.
pub const MAX_THREADS: i32 = 256;

/// Where an engine of a list runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecDevice {
    Cpu,
    /// llama.cpp's GPU device (`gpu`, or a name starting with "gpu" and no device).
    Gpu,
    /// llama.cpp's RPC backend: the `HOST:PORT` endpoints of one or more `rpc-server`s.
    Rpc(Vec<String>),
}

/// One entry of an engine list: `NAME[:DEVICE[:THREADS[:CORES]]]` or `NAME:rpc:ENDPOINTS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSpec {
    pub name: String,
    pub device: SpecDevice,
    /// `None`: the caller's default.
    pub threads: Option<i32>,
    /// Empty: wherever the OS puts the threads. Each below [`MAX_CORES`].
    pub cores: Vec<usize>,
}

/// The devices of an engine list, in order ([`parse_list`]'s errors).
pub fn devices(spec: &str) -> Result<Vec<SpecDevice>, String> {
    Ok(parse_list(spec)?.into_iter().map(|e| e.device).collect())
}

/// Engines from a list such as `cpu`, `cpu,gpu`, `big:cpu:4:4-7,little:cpu:4:0-3` or
/// `cpu,far:rpc:10.0.0.2:50052`: each entry is `NAME[:DEVICE[:THREADS[:CORES]]]`, DEVICE `cpu` or
/// `gpu` (default: `gpu` for a name starting with "gpu", else `cpu`), THREADS 1 to
/// [`MAX_THREADS`], CORES a list of cores and ranges joined by `+` (`0-3`, `4+6`); or
/// `NAME:rpc:HOST:PORT[+HOST:PORT...]`, an engine whose layers run on llama.cpp `rpc-server`s. The
/// error says which entry is wrong and why.
pub fn parse_list(spec: &str) -> Result<Vec<EngineSpec>, String> {
    let mut engines: Vec<EngineSpec> = vec![];
    for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let bad = |why: &str| {
            format!(
                "engine \"{entry}\": {why} (expected NAME[:cpu|gpu[:THREADS[:CORES]]] or NAME:rpc:HOST:PORT[+HOST:PORT...])"
            )
        };
        let mut parts = entry.split(':');
        let name = parts.next().unwrap_or_default();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') || name == "auto"
        {
            return Err(bad("invalid name"));
        }
        if engines.iter().any(|e| e.name == name) {
            return Err(bad("duplicate name"));
        }
        let device = match parts.next() {
            None if name.starts_with("gpu") => SpecDevice::Gpu,
            None | Some("cpu") => SpecDevice::Cpu,
            Some("gpu") => SpecDevice::Gpu,
            Some("rpc") => {
                // The rest of the entry: endpoints have colons of their own.
                let rest = entry.split_once(":rpc:").map_or("", |(_, rest)| rest);
                let endpoints = parse_endpoints(rest).ok_or_else(|| bad("bad RPC endpoint list"))?;
                engines.push(EngineSpec {
                    name: name.into(),
                    device: SpecDevice::Rpc(endpoints),
                    threads: None,
                    cores: vec![],
                });
                continue;
            }
            Some(_) => return Err(bad("unknown device")),
        };
        let threads = match parts.next() {
            None => None,
            Some(t) => Some(
                t.parse::<i32>()
                    .ok()
                    .filter(|t| (1..=MAX_THREADS).contains(t))
                    .ok_or_else(|| bad("bad thread count"))?,
            ),
        };
        let cores = match parts.next() {
            None => Vec::new(),
            Some(list) => parse_cores(list).ok_or_else(|| bad("bad core list"))?,
        };
        if parts.next().is_some() {
            return Err(bad("too many fields"));
        }
        engines.push(EngineSpec { name: name.into(), device, threads, cores });
    }
    if engines.is_empty() {
        return Err("no engine configured".into());
    }
    Ok(engines)
}

/// Most RPC servers one engine may name (ggml-rpc's `GGML_RPC_MAX_SERVERS`).
pub const MAX_RPC_SERVERS: usize = 16;

/// `HOST:PORT` endpoints joined by `+`: HOST a name or an IPv4 address (letters, digits, `.`,
/// `-`, `_`), PORT 1 to 65535, each endpoint once, at most [`MAX_RPC_SERVERS`].
pub fn parse_endpoints(list: &str) -> Option<Vec<String>> {
    let mut endpoints: Vec<String> = vec![];
    for endpoint in list.split('+') {
        let (host, port) = endpoint.split_once(':')?;
        let host_ok = !host.is_empty()
            && host.len() <= 253
            && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_');
        let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0) && port.chars().all(|c| c.is_ascii_digit());
        if !host_ok || !port_ok || endpoints.iter().any(|e| e == endpoint) || endpoints.len() == MAX_RPC_SERVERS {
            return None;
        }
        endpoints.push(endpoint.to_owned());
    }
    Some(endpoints)
}

/// Cores such as `0-3`, `4+6` or `0-1+4`, each below [`MAX_CORES`] (a range is never expanded
/// past it: `0-99999999999` is refused, not allocated).
pub fn parse_cores(list: &str) -> Option<Vec<usize>> {
    let core = |s: &str| s.parse::<usize>().ok().filter(|&c| c < MAX_CORES);
    let mut cores = vec![];
    for part in list.split('+') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (core(a)?, core(b)?);
                if a > b {
                    return None;
                }
                cores.extend(a..=b);
            }
            None => cores.push(core(part)?),
        }
    }
    Some(cores)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_lists_stay_within_the_cpu_set() {
        assert_eq!(parse_cores("0-1+4"), Some(vec![0, 1, 4]));
        assert_eq!(parse_cores("1023"), Some(vec![1023]));
        for bad in ["1024", "0-1024", "0-99999999999", "0-18446744073709551615", "", "-", "1-", "+", "3-2"] {
            assert_eq!(parse_cores(bad), None, "{bad:?} must be refused");
        }
    }

    #[test]
    fn specs_keep_what_was_written() {
        let e = parse_list(" gpu , big:cpu:2:2-3+6").unwrap();
        assert_eq!(
            e,
            [
                EngineSpec { name: "gpu".into(), device: SpecDevice::Gpu, threads: None, cores: vec![] },
                EngineSpec { name: "big".into(), device: SpecDevice::Cpu, threads: Some(2), cores: vec![2, 3, 6] },
            ]
        );
        let e = parse_list("cpu,far:rpc:10.0.0.2:50052+gpu-box:50053").unwrap();
        assert_eq!(e[1].device, SpecDevice::Rpc(vec!["10.0.0.2:50052".into(), "gpu-box:50053".into()]));
        for bad in [
            "far:rpc",
            "far:rpc:",
            "far:rpc:host",
            "far:rpc:host:0",
            "far:rpc:host:65536",
            "far:rpc::1",
            "far:rpc:h:1+h:1",
            "far:rpc:h:1:2",
            "far:rpc:h:+1",
            "far:rpc:h:1+",
        ] {
            let e = parse_list(bad).unwrap_err();
            assert!(e.contains("bad RPC endpoint list"), "{bad:?}: {e}");
        }
        assert_eq!(parse_list(" , ").unwrap_err(), "no engine configured");
        // Found by fuzz/ (engines): the old parser tried to allocate this range and aborted.
        assert!(parse_list("gpu0:gpu:2:0-1999999999999999+0:04").is_err());
        let e = parse_list("a:cpu:1:0-5000").unwrap_err();
        assert!(e.contains("engine \"a:cpu:1:0-5000\": bad core list"), "{e}");
    }
}
