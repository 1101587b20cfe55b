//! What `vlmpublish` checks and derives without a broker: the `address` and `topic` a setter
//! accepts, the lines of a text buffer, and the topic each line goes to.

/// The placeholders `topic` may hold.
pub(super) const PLACEHOLDERS: [&str; 2] = ["{stream}", "{type}"];

/// The longest topic MQTT encodes (its length is two bytes).
pub(super) const MAX_TOPIC: usize = u16::MAX as usize;

/// What `{stream}` becomes for a line that names no stream.
pub(super) const UNKNOWN_STREAM: &str = "unknown";

/// `host:port` (an IPv6 address as `[addr]:port`), the port required: the host and port, or why
/// not.
pub(super) fn parse_address(address: &str) -> Result<(String, u16), String> {
    if address.contains("://") {
        return Err(format!("{address:?} is a URL: use host:port (and tls=true for TLS)"));
    }
    let (host, port) = if let Some(rest) = address.strip_prefix('[') {
        let (host, port) = rest.split_once("]:").ok_or_else(|| format!("{address:?}: use [IPv6 address]:port"))?;
        (host, port)
    } else {
        let (host, port) = address.rsplit_once(':').ok_or_else(|| format!("{address:?} has no port: use host:port"))?;
        if host.contains(':') {
            return Err(format!("{address:?}: write an IPv6 address as [address]:port"));
        }
        (host, port)
    };
    if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c == '/') {
        return Err(format!("{address:?} has no valid host: use host:port"));
    }
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok((host.to_string(), port)),
        _ => Err(format!("{address:?} has no valid port (1-65535): use host:port")),
    }
}

/// A topic template is non-empty, has no wildcard (`+`, `#`: not allowed in a published topic)
/// and no placeholder but `{stream}` and `{type}`.
pub(super) fn check_topic(topic: &str) -> Result<(), String> {
    if topic.is_empty() {
        return Err("the topic is empty".into());
    }
    if topic.contains(['+', '#', '\0']) {
        return Err(format!("topic {topic:?} has a wildcard (+ or #), not allowed when publishing"));
    }
    let mut rest = topic.to_string();
    for p in PLACEHOLDERS {
        rest = rest.replace(p, "");
    }
    if rest.contains(['{', '}']) {
        return Err(format!("topic {topic:?} has a placeholder other than {{stream}} and {{type}}"));
    }
    if topic.len() > 60000 {
        return Err("the topic is longer than 60000 bytes".into());
    }
    Ok(())
}

/// What a line is, which decides `{type}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A JSON object without `"type":"alert"` (an answer line of `vlmquery output-format=json`,
    /// a streamed piece or a failed answer included).
    Answer,
    /// A JSON object with `"type":"alert"` (a `vlm-alert` line).
    Alert,
    /// Anything else (`output-format=text`, or text from elsewhere): published as it is.
    Text,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Answer => "answer",
            Kind::Alert => "alert",
            Kind::Text => "text",
        }
    }
}

/// The kind of `line` and the stream it names (its `"stream"` field), if any.
pub(super) fn classify(line: &[u8]) -> (Kind, Option<String>) {
    match serde_json::from_slice::<serde_json::Value>(line) {
        Ok(serde_json::Value::Object(o)) => {
            let kind = if o.get("type").and_then(|t| t.as_str()) == Some("alert") { Kind::Alert } else { Kind::Answer };
            (kind, o.get("stream").and_then(|s| s.as_str()).map(str::to_string))
        }
        _ => (Kind::Text, None),
    }
}

/// The topic of a line: `template` with `{stream}` and `{type}` replaced, each value made one
/// topic level (`/`, `+`, `#` and control characters, NUL among them, become `_`; an empty
/// stream name becomes "unknown").
pub(super) fn topic_for(template: &str, stream: &str, kind: Kind) -> String {
    let stream: String = if stream.is_empty() {
        UNKNOWN_STREAM.into()
    } else {
        stream.chars().map(|c| if matches!(c, '/' | '+' | '#') || c.is_control() { '_' } else { c }).collect()
    };
    template.replace("{stream}", &stream).replace("{type}", kind.name())
}

/// The non-empty lines of a buffer: split on `\n`, a trailing `\r` removed, blank lines left out.
pub(super) fn lines(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    data.split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .filter(|l| l.iter().any(|b| !b.is_ascii_whitespace()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(parse_address("localhost:1883"), Ok(("localhost".into(), 1883)));
        assert_eq!(parse_address("[::1]:8883"), Ok(("::1".into(), 8883)));
        for bad in ["localhost", "::1:1883", "mqtt://localhost:1883", ":1883", "host:0", "host:70000", "host:x", ""] {
            assert!(parse_address(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn topics() {
        assert!(check_topic("gst-vlm/{stream}/{type}").is_ok());
        assert!(check_topic("plain").is_ok());
        for bad in ["", "a/+/b", "a/#", "{camera}/x", "a/{stream"] {
            assert!(check_topic(bad).is_err(), "{bad}");
        }
        assert_eq!(topic_for("c/{stream}/{type}", "cam/1+#", Kind::Alert), "c/cam_1__/alert");
        assert_eq!(topic_for("c/{stream}/{type}", "", Kind::Text), "c/unknown/text");
        assert_eq!(topic_for("c/{stream}", "a\u{0}b\nc\u{7f}", Kind::Text), "c/a_b_c_");
    }

    #[test]
    fn lines_and_kinds() {
        let data = b"{\"id\":\"q1\",\"stream\":\"door\"}\n\n  \r\n{\"type\":\"alert\",\"stream\":\"yard\"}\r\nplain";
        let lines: Vec<_> = lines(data).collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(classify(lines[0]), (Kind::Answer, Some("door".into())));
        assert_eq!(classify(lines[1]), (Kind::Alert, Some("yard".into())));
        assert_eq!(classify(lines[2]), (Kind::Text, None));
        assert_eq!(classify(b"[1,2]"), (Kind::Text, None));
    }
}
