# The index math of load_patch_wide (cuda/kernels/stem_conv.cuh), emulated on byte arrays: the
# patch it unpacks equals a direct gather of x (zeros outside the image) on every tile of five
# shapes at six start offsets of x, and every byte it reads lies inside x. Plain python3.
import random
kPatchH,kPatchW,kTileH,kTileW=21,38,8,16
def run(N,H,W,xa_off,n,oh0,ow0,mem):
    # mem: bytearray storage; x at byte offset xa_off, N*H*W*6 bytes
    xa=xa_off; xend=xa+N*H*W*6
    ih0,iw0=2*oh0-3,2*ow0-3
    c0=-iw0 if iw0<0 else 0; c1=min(W-iw0,kPatchW)
    raw=bytearray(b'\xee'*(kPatchH*256))
    origin=lambda r: xa+((n*H+ih0+r)*W*6+iw0*6)
    reads=[]
    for slot in range(kPatchH*16):
        r,k=slot>>4,slot&15; ih=ih0+r
        if ih<0 or ih>=H or c1<=c0: continue
        first=origin(r)+6*c0; end=origin(r)+6*c1
        src=(first&~15)+16*k
        if src>=end: continue
        if src>=xa and src+16<=xend:
            assert src%16==0
            raw[r*256+16*k:r*256+16*k+16]=mem[src:src+16]; reads.append((src,src+16))
        else:
            for e in range(8):
                a=src+2*e
                if first<=a<end:
                    raw[r*256+16*k+2*e:r*256+16*k+2*e+2]=mem[a:a+2]; reads.append((a,a+2))
        assert 16*k+16<=256
    for lo,hi in reads: assert xa<=lo and hi<=xend, (lo,hi,xa,xend)
    patch=[]
    for i in range(kPatchH*kPatchW):
        r,c=divmod(i,kPatchW); ih=ih0+r
        if 0<=ih<H and c0<=c<c1:
            first=origin(r)+6*c0
            off=origin(r)+6*c-(first&~15)
            assert 0<=off and off+6<=256
            patch.append(bytes(raw[r*256+off:r*256+off+6]))
        else: patch.append(bytes(6))
    return patch
def ref(N,H,W,xa,n,oh0,ow0,mem):
    ih0,iw0=2*oh0-3,2*ow0-3; out=[]
    for i in range(kPatchH*kPatchW):
        r,c=divmod(i,kPatchW); ih,iw=ih0+r,iw0+c
        if 0<=ih<H and 0<=iw<W:
            a=xa+((n*H+ih)*W+iw)*6; out.append(bytes(mem[a:a+6]))
        else: out.append(bytes(6))
    return out
random.seed(1); cnt=0
for (N,H,W) in [(2,32,32),(3,48,64),(1,31,63),(2,224,224),(1,15,31)]:
    OH,OW=(H-1)//2+1,(W-1)//2+1
    for xa_off in [0,2,6,12,14,16]:
        size=xa_off+N*H*W*6
        mem=bytearray(random.getrandbits(8) for _ in range(size))
        for n in range(N):
            for oh0 in range(0,OH-kTileH+1,kTileH):
                for ow0 in range(0,OW-kTileW+1,kTileW):
                    assert run(N,H,W,xa_off,n,oh0,ow0,mem)==ref(N,H,W,xa_off,n,oh0,ow0,mem); cnt+=1
print("tiles checked",cnt)
