//! The frame index: one entry per frame of the video stream in presentation order, built by demuxing
//! packets (no decoding). Frame `i` of a video is the i-th entry here, the numbering decord and
//! torchvision's readers use, so frame indices chosen by a sampling rule mean the same frames.

/// One packet of the video stream as the demuxer saw it.
#[derive(Debug, Clone, Copy)]
pub struct PacketEntry {
    /// Presentation timestamp in stream time base (the decode timestamp or the packet's position when
    /// the container gives none).
    pub pts: i64,
    /// Whether decoding can start at this packet.
    pub key: bool,
}

/// Frames in presentation order.
#[derive(Debug, Default)]
pub struct FrameIndex {
    /// Presentation timestamps, ascending.
    pts: Vec<i64>,
    /// Presentation timestamps of keyframes, ascending.
    keyframe_pts: Vec<i64>,
}

impl FrameIndex {
    pub fn new(mut packets: Vec<PacketEntry>) -> FrameIndex {
        let keyframe_pts = {
            let mut k: Vec<i64> = packets.iter().filter(|p| p.key).map(|p| p.pts).collect();
            k.sort_unstable();
            k
        };
        packets.sort_by_key(|p| p.pts);
        FrameIndex {
            pts: packets.iter().map(|p| p.pts).collect(),
            keyframe_pts,
        }
    }

    pub fn len(&self) -> u64 {
        self.pts.len() as u64
    }

    /// Presentation timestamp of frame `index`.
    pub fn pts(&self, index: u64) -> Option<i64> {
        self.pts.get(usize::try_from(index).ok()?).copied()
    }

    pub fn first_pts(&self) -> Option<i64> {
        self.pts.first().copied()
    }

    pub fn last_pts(&self) -> Option<i64> {
        self.pts.last().copied()
    }

    /// The frame a decoded picture with timestamp `pts` is: the last frame whose timestamp is not
    /// after it (decoders may report slightly different timestamps than the packets carried).
    pub fn frame_at(&self, pts: i64) -> u64 {
        self.pts.partition_point(|&p| p <= pts).saturating_sub(1) as u64
    }

    /// The timestamp of the last keyframe at or before `pts`, where decoding must start to reach it.
    pub fn keyframe_before(&self, pts: i64) -> Option<i64> {
        let at = self.keyframe_pts.partition_point(|&k| k <= pts);
        at.checked_sub(1).map(|i| self.keyframe_pts[i])
    }

    /// Frame indices of the keyframes (scene cuts, for encoders that place keyframes at cuts).
    pub fn keyframe_indices(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .keyframe_pts
            .iter()
            .map(|&k| self.frame_at(k))
            .collect();
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_by_presentation_and_finds_keyframes() {
        // Decode order I P B B (pts 0 3 1 2), then I P (pts 4 5).
        let packets = [
            (0, true),
            (3, false),
            (1, false),
            (2, false),
            (4, true),
            (5, false),
        ]
        .map(|(pts, key)| PacketEntry { pts, key })
        .to_vec();
        let index = FrameIndex::new(packets);
        assert_eq!(index.len(), 6);
        assert_eq!(index.pts(3), Some(3));
        assert_eq!(index.keyframe_indices(), vec![0, 4]);
        assert_eq!(index.keyframe_before(3), Some(0));
        assert_eq!(index.keyframe_before(5), Some(4));
        assert_eq!(index.frame_at(2), 2);
        assert_eq!(index.frame_at(-7), 0);
        assert_eq!(index.pts(6), None);
    }
}
