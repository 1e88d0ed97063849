//! Display rotation: containers store it as a 3×3 16.16 fixed-point matrix; players turn the decoded
//! picture by it. Frames are handed out upright, as a viewer sees them.

/// The clockwise rotation in degrees (0, 90, 180 or 270) a display matrix asks for, as FFmpeg's
/// `av_display_rotation_get` (negated, rounded to a quarter turn) computes it; `None` for a degenerate
/// matrix or bytes that are not one.
pub fn display_matrix_rotation(bytes: &[u8]) -> Option<u32> {
    if bytes.len() < 36 {
        return None;
    }
    let m = |i: usize| {
        let raw = i32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ]);
        f64::from(raw) / 65536.0
    };
    let scale0 = m(0).hypot(m(3));
    let scale1 = m(1).hypot(m(4));
    if scale0 == 0.0 || scale1 == 0.0 {
        return None;
    }
    // av_display_rotation_get is the counter-clockwise angle; a player turns the picture clockwise by it.
    let counter_clockwise = -(m(1) / scale1).atan2(m(0) / scale0).to_degrees();
    let clockwise = (-counter_clockwise).rem_euclid(360.0);
    let quarter = ((clockwise / 90.0).round() as u32) % 4;
    Some(quarter * 90)
}

/// Rotate a packed RGB picture clockwise by `degrees` (a multiple of 90). Returns the new width and
/// height with the pixels.
pub fn rotate_rgb(rgb: Vec<u8>, width: u32, height: u32, degrees: u32) -> (u32, u32, Vec<u8>) {
    let (w, h) = (width as usize, height as usize);
    match degrees % 360 {
        90 => {
            let mut out = vec![0u8; rgb.len()];
            // Output is h wide, w high: out(x', y') = in(y', h-1-x').
            for y in 0..h {
                for x in 0..w {
                    let (nx, ny) = (h - 1 - y, x);
                    let src = 3 * (y * w + x);
                    let dst = 3 * (ny * h + nx);
                    out[dst..dst + 3].copy_from_slice(&rgb[src..src + 3]);
                }
            }
            (height, width, out)
        }
        180 => {
            let mut out = rgb;
            let pixels = w * h;
            for i in 0..pixels / 2 {
                let j = pixels - 1 - i;
                for c in 0..3 {
                    out.swap(3 * i + c, 3 * j + c);
                }
            }
            (width, height, out)
        }
        270 => {
            let mut out = vec![0u8; rgb.len()];
            for y in 0..h {
                for x in 0..w {
                    let (nx, ny) = (y, w - 1 - x);
                    let src = 3 * (y * w + x);
                    let dst = 3 * (ny * h + nx);
                    out[dst..dst + 3].copy_from_slice(&rgb[src..src + 3]);
                }
            }
            (height, width, out)
        }
        _ => (width, height, rgb),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(a: f64, b: f64, c: f64, d: f64) -> Vec<u8> {
        let fp = |v: f64| ((v * 65536.0).round() as i32).to_le_bytes();
        let mut out = Vec::new();
        for v in [
            fp(a),
            fp(b),
            [0; 4],
            fp(c),
            fp(d),
            [0; 4],
            [0; 4],
            [0; 4],
            (1i32 << 30).to_le_bytes(),
        ] {
            out.extend_from_slice(&v);
        }
        out
    }

    #[test]
    fn reads_quarter_turns() {
        // Identity, and the matrices FFmpeg's av_display_rotation_set writes for -90, 180, 90 degrees
        // counter-clockwise (= 90, 180, 270 clockwise).
        assert_eq!(
            display_matrix_rotation(&matrix(1.0, 0.0, 0.0, 1.0)),
            Some(0)
        );
        assert_eq!(
            display_matrix_rotation(&matrix(0.0, 1.0, -1.0, 0.0)),
            Some(90)
        );
        assert_eq!(
            display_matrix_rotation(&matrix(-1.0, 0.0, 0.0, -1.0)),
            Some(180)
        );
        assert_eq!(
            display_matrix_rotation(&matrix(0.0, -1.0, 1.0, 0.0)),
            Some(270)
        );
        assert_eq!(display_matrix_rotation(&matrix(0.0, 0.0, 0.0, 0.0)), None);
        assert_eq!(display_matrix_rotation(&[0; 8]), None);
    }

    #[test]
    fn rotates_pixels() {
        // 2×1 picture: red, green.
        let rgb = vec![255, 0, 0, 0, 255, 0];
        let (w, h, out) = rotate_rgb(rgb.clone(), 2, 1, 90);
        assert_eq!((w, h), (1, 2));
        assert_eq!(out, vec![255, 0, 0, 0, 255, 0]); // red on top after a clockwise turn
        let (w, h, out) = rotate_rgb(rgb.clone(), 2, 1, 270);
        assert_eq!((w, h), (1, 2));
        assert_eq!(out, vec![0, 255, 0, 255, 0, 0]);
        let (_, _, out) = rotate_rgb(rgb.clone(), 2, 1, 180);
        assert_eq!(out, vec![0, 255, 0, 255, 0, 0]);
        assert_eq!(rotate_rgb(rgb.clone(), 2, 1, 0).2, rgb);
    }
}
